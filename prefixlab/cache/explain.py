"""Why a request reused what it reused: reason codes, per-request reports and a bounded log of evictions.

A row of a request reuses `reused` tokens; the store shared `shared` tokens of its prompt and held its deepest
reusable checkpoint at `checkpoint` (<= shared). The row's `reason` names what limited it, in this order:
refused_input, too_short, batch_alignment (reused < checkpoint), evicted / no_checkpoint (checkpoint < shared),
evicted / other_namespace (shared stopped short of the prompt), else hit (everything the store shares was reused)
or cold (nothing of the prompt was ever cached).
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

REASONS = {
    "hit": "reused everything the store shares with the prompt (the rest is new to the store; the last token runs)",
    "cold": "nothing cached shares a prefix with this prompt",
    "no_checkpoint": "the store shares more tokens than its deepest checkpoint: no state was captured there yet (on "
                     "first sight of a branch point, dp / marconi / sglang+ capture one in this prefill, so the next "
                     "such request hits, unless the model cannot split its prefill there: patch=False on Nemotron-H "
                     "/ Zamba2; vllm+ and +block placements keep states at block ends only)",
    "evicted": "a deeper checkpoint or prefix of this prompt was cached and evicted for capacity",
    "other_namespace": "another namespace holds a longer prefix of this prompt; namespaces never share entries",
    "too_short": "the prompt has fewer than 2 tokens: its last token always runs, so nothing can be reused",
    "batch_alignment": "the batch resumes all rows at one padded column; this row dropped to a shallower checkpoint",
    "refused_input": "ran uncached, nothing admitted: the attention mask or position_ids are not plain left padding, "
                     "left pads change this model's states, or the prompt reaches its RoPE's rescaling length",
}
MISS_REASONS = tuple(r for r in REASONS if r != "hit")


@dataclass
class RowReport:
    """What happened to one row (sequence) of a request. Token counts are the row's real tokens (no pads)."""

    prompt_tokens: int
    reused: int = 0
    shared: int = 0  # tokens of the prompt (all but its last) the store shared with it
    checkpoint: int = 0  # the deepest reusable checkpoint, <= shared
    reason: str = "cold"
    from_host: bool = False  # loaded from the host (offload) tier

    def __str__(self) -> str:
        return (f"reused {self.reused} of {self.prompt_tokens} prompt tokens (shared prefix {self.shared}, deepest "
                f"checkpoint {self.checkpoint}{', from the host tier' if self.from_host else ''}): {self.reason} - "
                f"{REASONS[self.reason]}")


@dataclass
class RequestReport:
    """One HybridPrefixCache request (`cache.report()`): a RowReport per row, and what the request admitted (every
    row it held, after beam reordering / num_return_sequences). `str()` prints it."""

    rows: list[RowReport] = field(default_factory=list)
    admission: str = "pending (admitted on the store's next use)"
    admitted_tokens: int = 0  # new tokens (KV) stored
    admitted_states: int = 0  # new recurrent-state checkpoints stored
    refused_rows: int = 0  # rows the budget could not hold at all (not stored; store.stats()['rejected'])
    # decoded tokens held but not admitted: a decode step computed what a prefill would not (model_info.py)
    decoded_left_out: int = 0
    # tokens held but past what the request may admit (a media placeholder, the model's store.admit_limit)
    limited_left_out: int = 0

    @property
    def reused(self) -> int:
        return max((row.reused for row in self.rows), default=0)

    @property
    def reasons(self) -> list[str]:
        return [row.reason for row in self.rows]

    def add_admission(self, admission) -> None:
        """Count one row's core Admission (cache/core.py)."""
        self.admitted_tokens += admission.tokens
        self.admitted_states += admission.states
        self.refused_rows += 0 if admission else 1
        self._describe()

    def leave_out(self, decoded: int, limited: int) -> None:
        """The request's last `limited` + `decoded` tokens are not admitted (cache/hf.py commit): `limited` past what
        the request may admit, then `decoded` ones a decode step computed otherwise than a prefill."""
        self.decoded_left_out, self.limited_left_out = decoded, limited
        if self.admission.startswith("admitted"):
            self._describe()

    def _describe(self) -> None:
        self.admission = (f"admitted {self.admitted_tokens} new tokens and {self.admitted_states} new states"
                          + (f"; {self.refused_rows} row(s) refused for capacity" if self.refused_rows else "")
                          + (f"; {self.limited_left_out} tokens left out past a media placeholder or the model's "
                             "store.admit_limit" if self.limited_left_out else "")
                          + (f"; its last {self.decoded_left_out} decoded tokens left out (a decode step of this "
                             "model computed what a prefill would not)" if self.decoded_left_out else ""))

    def __str__(self) -> str:
        if not self.rows:
            return "no request yet (the cache has not run a forward)"
        lines = [str(self.rows[0])] if len(self.rows) == 1 else [f"row {i}: {r}" for i, r in enumerate(self.rows)]
        return "\n".join([*lines, self.admission])


def format_reasons(counts: dict[str, int]) -> str:
    """One line from `store.stats()['reasons']`, e.g. "hit 12, no_checkpoint 3, cold 2" (zero counts left out)."""
    return ", ".join(f"{reason} {n}" for reason, n in counts.items() if n) or "no requests"


class EvictionLog:
    """A bounded memory of what was evicted: (namespace, depth, hash of the first `depth` tokens) for each evicted
    checkpoint position and leaf end. At most `max_entries` (oldest forgotten first: 8-byte digests, about 100
    bytes per entry with the dict overhead); a request whose prefix was evicted longer ago reads as never cached."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int, bytes], None] = OrderedDict()
        self._depths: dict[str, Counter] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, namespace: str, tokens: np.ndarray, depths: list[int]) -> None:
        """`tokens` is the evicted node's path (its first max(depths) tokens at least)."""
        for depth, digest in zip(sorted(set(depths)), _prefix_digests(tokens, sorted(set(depths))), strict=True):
            key = (namespace, depth, digest)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = None
            self._depths.setdefault(namespace, Counter())[depth] += 1
            if len(self._entries) > self.max_entries:
                (old_ns, old_depth, _), _ = self._entries.popitem(last=False)
                counts = self._depths[old_ns]
                counts[old_depth] -= 1
                if not counts[old_depth]:
                    del counts[old_depth]
                    if not counts:  # (one namespace per tenant or session: none kept once forgotten)
                        del self._depths[old_ns]

    def evicted_between(self, namespace: str, tokens: np.ndarray, low: int, high: int) -> bool:
        """Whether a prefix tokens[:d] with low < d <= high was evicted (and is still remembered)."""
        known = sorted(self._depths.get(namespace, ()))
        depths = known[bisect.bisect_right(known, low): bisect.bisect_right(known, min(high, len(tokens)))]
        return any((namespace, d, digest) in self._entries
                   for d, digest in zip(depths, _prefix_digests(tokens, depths), strict=True))


def why(core, tokens: np.ndarray, match) -> str:
    """Why a live core `match` of `tokens` reuses no more: one of hit, cold, no_checkpoint, evicted (needs a core
    built with explain=True) and other_namespace."""
    log, namespace = core.evicted, match.namespace
    if match.length < match.shared_length:
        evicted = log is not None and log.evicted_between(namespace, tokens, match.length, match.shared_length)
        return "evicted" if evicted else "no_checkpoint"
    if match.shared_length < len(tokens):
        if log is not None and log.evicted_between(namespace, tokens, match.shared_length, len(tokens)):
            return "evicted"
        if len(core.tree.roots) > (namespace in core.tree.roots) and core.tree.namespace_index().holds_other(
                namespace, tokens, match.shared_length + 1):
            return "other_namespace"
    return "hit" if match.length else "cold"


def _prefix_digests(tokens: np.ndarray, depths: list[int]) -> list[bytes]:
    """8-byte digests of tokens[:d] for each d of the sorted `depths`, in one incremental pass."""
    hasher, done, out = hashlib.blake2b(digest_size=8), 0, []
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    for depth in depths:
        hasher.update(tokens[done:depth].tobytes())
        done = depth
        out.append(hasher.copy().digest())
    return out
