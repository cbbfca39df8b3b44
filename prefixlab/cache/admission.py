"""Admission policies: which recurrent-state checkpoints a request should capture and the cache keep.

- `BlockAdmission` (vllm+): a state every `block_size` tokens and at the end of the sequence; when a later
  sequence extends a partial last block, the old end state is superseded (vLLM+ fills the block in place).
- `MarconiAdmission` (sglang+, marconi): the state after the last token, plus the state at the branch point when
  the speculative insertion of the sequence would split an existing edge (Marconi section 4.1).
- `PlacedAdmission` (marconi+balanced|block|log) and `DPAdmission` (dp): Marconi's positions plus checkpoints
  placed inside the part of the sequence the request computes anyway.

`refresh_path` says how hits refresh timestamps: SGLang / vLLM refresh every node on the matched path, Marconi
only the node whose checkpoint is reused (section 4.3).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixlab.cache.tree import Node, RadixTree, Walk


def _has_checkpoint_at(walk: Walk, position: int) -> bool:
    node = walk.path[-1]
    i = node.checkpoint_at_or_before(position)
    return i >= 0 and node.ckpt_pos[i] == position


class MarconiAdmission:
    """Branch point (speculative insertion) and the last token."""

    refresh_path = False

    def plan(self, walk: Walk, length: int, reused: int) -> list[int]:
        shared = walk.shared_length
        positions = {length} if length > reused else set()
        if reused < shared < length and not _has_checkpoint_at(walk, shared):
            positions.add(shared)
        return sorted(positions)

    def observe(self, shared_length: int, reused_length: int) -> None:
        """Called with every request's overlap with the tree and the part of it a checkpoint let it reuse."""

    def after_admit(self, tree: RadixTree, deepest: Node, length: int) -> None:
        """Housekeeping once a sequence of `length` tokens ending at `deepest` was admitted."""


class SGLangAdmission(MarconiAdmission):
    """SGLang+ = Marconi's admission with SGLang's LRU bookkeeping (every node on a hit path is refreshed)."""

    refresh_path = True


class BlockAdmission(MarconiAdmission):
    """vLLM+: every block boundary and the sequence end."""

    refresh_path = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def plan(self, walk: Walk, length: int, reused: int) -> list[int]:
        first = (reused // self.block_size + 1) * self.block_size
        positions = list(range(first, length + 1, self.block_size))
        return positions + [length] if length > reused and length % self.block_size else positions

    def after_admit(self, tree: RadixTree, deepest: Node, length: int) -> None:
        node = deepest
        while not node.is_root:
            stale = [i for i, p in enumerate(node.ckpt_pos) if p < length and p % self.block_size]
            for i in reversed(stale):
                tree.drop_checkpoints(node, i, i + 1)
            node = node.parent


class PlacedAdmission(MarconiAdmission):
    """Marconi's positions plus `placement(reused, length)` positions strictly inside (reused, length): the
    request computes those tokens anyway, so their states cost only memory."""

    def __init__(self, placement: Callable[[int, int], list[int]]) -> None:
        self.placement = placement

    def plan(self, walk: Walk, length: int, reused: int) -> list[int]:
        placed = [p for p in self.placement(reused, length) if reused < p < length] if length > reused + 1 else []
        return sorted(set(super().plan(walk, length, reused)).union(placed))


class DPAdmission(PlacedAdmission):
    """Marconi's positions plus the sparse-prefix-caching DP placement for the observed overlap law.

    What a checkpoint can recover is the overlap a request could not reuse: each request contributes its shared
    length when it exceeded what a checkpoint let it reuse, and 0 (nothing to recover) otherwise. The decayed
    histogram of those depths is solved at `block` granularity every `resolve_every` requests.

    Budget per entry: a state is worth `state_tokens` tokens of KV, so an entry computing n new tokens gets at most
    `memory_fraction * n / state_tokens` placed states (its placed states cost at most that fraction of its KV)
    and never more than `budget`; with the branch point and the last token an entry holds <= budget + 2 states."""

    def __init__(
        self, budget: int, block: int, decay: float, resolve_every: int, state_tokens: float,
        memory_fraction: float = 0.15, max_len: int = 1 << 16,
    ) -> None:
        from prefixlab.cache.placement import OverlapHistogram

        self.histogram, self.budget, self.block = OverlapHistogram(max_len, decay, block, resolve_every), budget, block
        self.state_tokens, self.memory_fraction = state_tokens, memory_fraction
        self.deepest_loss = 0
        super().__init__(self._positions)

    def _positions(self, reused: int, length: int) -> list[int]:
        budget = min(self.budget, int(self.memory_fraction * (length - reused) / max(self.state_tokens, 1e-9)))
        if self.deepest_loss < self.block or length < self.block or budget < 1:
            return []  # nothing a checkpoint could recover, or the entry is too small to pay for one
        # The block DP depends on the length only through its whole blocks: round down so solutions are shared.
        return self.histogram.positions(length // self.block * self.block, budget)

    def observe(self, shared_length: int, reused_length: int) -> None:
        lost = min(shared_length if shared_length > reused_length else 0, self.histogram.max_len)
        self.deepest_loss = max(self.deepest_loss, lost)
        self.histogram.observe(lost)
