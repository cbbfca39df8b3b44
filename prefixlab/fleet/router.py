"""Request routers for a fleet of replicas, each with its own prefix cache.

    router = make_router("affinity", replicas=8, caches=cores)   # cores: what each replica holds (optional)
    choice = router.choose(input_tokens)            # replica and the prefix it is expected to resume
    ...serve on choice.replica, reusing `hit` tokens...
    router.record(choice.replica, input_and_output_tokens, prefill_tokens=len(input_tokens) - hit)

`random` and `round-robin` ignore prefixes. `affinity` sends a request where the longest prefix can be *resumed*:
for a hybrid model the deepest recurrent checkpoint on the shared path, not the longest KV match. It keeps a radix
tree of what each replica was sent (a bit mask of replicas per edge): an upper bound of what each holds.

With `caches` (one per replica, anything with `peek(tokens) -> (resumable, shared)`, e.g. PrefixCacheCore: the
simulator's replica caches, or `prefixlab run`'s model-free copies of each process's store) the router asks the
replicas what they still hold, so evictions are seen: replicas are asked in decreasing order of their bound, and
asking stops once the best answer beats every remaining bound (the choice equals asking all of them). A replica
found to hold less of the path than it was sent has its bit cleared below that depth (it evicted the rest), so it is
not asked about that prefix again until it is sent it again. Without `caches` (the fallback) the router models each
replica as a Marconi-style cache that never evicts (a checkpoint where a sequence branched off what the replica held,
and one at its last token; `checkpointed=False`: every held token is resumable).

Balance is a constraint on the prefill work recorded per replica (`loads`): a replica is eligible only if its work
after the request stays within (1 + balance_eps) x the fleet's mean work after it; when none is, the replica with
the least work after the request gets it (often the one holding its prefix: elsewhere it costs its whole input).
Hence, as long as the work recorded is the work predicted (route(), or `caches` that answer exactly), at every
step max(loads) <= max((1 + balance_eps) x mean, mean + the longest request's input tokens): an eligible replica
stays under the first term (the mean only grows), a fallback's work after is at most the least-loaded replica's
plus one request. The second term is inherent: N + 1 requests of equal work on N replicas that share nothing put
two on one replica, 2N / (N + 1) x the mean, so (1 + balance_eps) x the mean can hold only where a request's work
is at most balance_eps x a replica's mean (small traces over many replicas fail this).
When a whole batch is known up front, `min_total_prefill_tokens` (a lower bound of the fleet's total work, e.g.
the batch's distinct prompt prefixes, which some replica must compute) stands in for the running total while it is
larger: early requests can then reuse (with the running mean alone the first replica to take a request is over
the bound and its siblings go elsewhere), and the bound above holds for the final loads.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prefixlab.cache.tokens import as_tokens
from prefixlab.cache.tree import Node, RadixTree, Walk
from prefixlab.errors import InvalidInputError, is_finite_number, is_int

ROUTING_NAMES = ("random", "round-robin", "affinity")


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes and how many of its tokens the router expects that replica to resume."""

    replica: int
    reusable_tokens: int


class Holders:
    """Which replicas hold an edge (a KV-like payload of the router tree: splits copy the mask) or a checkpoint."""

    __slots__ = ("ntokens", "mask")
    nbytes = 0

    def __init__(self, ntokens: int, mask: int) -> None:
        self.ntokens, self.mask = ntokens, mask

    def split(self, at: int) -> tuple[Holders, Holders]:
        return Holders(at, self.mask), Holders(self.ntokens - at, self.mask)

    def concat(self, other: Holders) -> Holders:
        return Holders(self.ntokens + other.ntokens, self.mask | other.mask)


class ReplicaCache(Protocol):
    """What the affinity router asks a replica: (resumable, shared) tokens of a request, changing nothing."""

    def peek(self, tokens: np.ndarray) -> tuple[int, int]: ...


def check_routing(name: str) -> str:
    if name not in ROUTING_NAMES:
        raise InvalidInputError(f"routing {name!r} is unknown; use one of {', '.join(ROUTING_NAMES)}")
    return name


class Router:
    """Shared bookkeeping: predicted prefill tokens per replica (`loads`). Subclasses pick the replica."""

    name = ""

    def __init__(self, replicas: int, seed: int = 0) -> None:
        if not is_int(replicas) or replicas < 1:
            raise InvalidInputError(f"replicas must be a positive int, got {replicas!r}")
        if not is_int(seed) or not 0 <= seed < 2**63:  # (None would draw a fresh seed: a route not replayable)
            raise InvalidInputError(f"seed must be an int in [0, 2**63), got {seed!r}")
        self.replicas = int(replicas)
        self.loads = np.zeros(replicas, dtype=np.int64)
        self.rng = np.random.default_rng(int(seed))

    def choose(self, tokens: np.ndarray) -> Choice:
        raise NotImplementedError

    def record(self, replica: int, tokens: np.ndarray, prefill_tokens: int) -> None:
        """`replica` served `tokens` (input, or input + output when known), computing `prefill_tokens` of them."""
        if not is_int(replica) or not 0 <= replica < self.replicas:
            raise InvalidInputError(f"replica must be an int in [0, {self.replicas}), got {replica!r}")
        self.loads[replica] += prefill_tokens

    def route(self, tokens: np.ndarray) -> Choice:
        """choose + record with the predicted prefill work (when the real hit is not known, e.g. a batch plan)."""
        choice = self.choose(tokens)
        self.record(choice.replica, tokens, len(tokens) - choice.reusable_tokens)
        return choice


class RandomRouter(Router):
    name = "random"

    def choose(self, tokens: np.ndarray) -> Choice:
        return Choice(int(self.rng.integers(self.replicas)), 0)


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, replicas: int, seed: int = 0) -> None:
        super().__init__(replicas, seed)
        self.next = 0

    def choose(self, tokens: np.ndarray) -> Choice:
        replica, self.next = self.next, (self.next + 1) % self.replicas
        return Choice(replica, 0)


def check_balance_eps(value: object, name: str = "balance_eps") -> float:
    """The affinity router's balance bound as a float: a finite number >= 0, else InvalidInputError naming `name`
    (the CLI flag where one gave it: `run` and its plan check theirs here; `simulate` parses its flag as a finite
    number >= 0 and its routers check it here). inf would lift the bound (every replica eligible however loaded), NaN
    or a negative one would make none eligible."""
    if not is_finite_number(value) or value < 0:
        shown = f"{value:g}" if is_finite_number(value) or isinstance(value, float) else repr(value)
        raise InvalidInputError(f"{name} {shown} must be a finite number >= 0 (e.g. 0.15)")
    return float(value)


class AffinityRouter(Router):
    """Longest resumable prefix under a balance constraint (see the module docstring).

    `caches`: per replica, what it holds (`peek`); `checkpointed=False`: any held token is resumable (KV-only
    replicas, or processes that prime every shared prefix)."""

    name = "affinity"

    def __init__(self, replicas: int, seed: int = 0, *, balance_eps: float = 0.15, checkpointed: bool = True,
                 caches: Sequence[ReplicaCache] | None = None, min_total_prefill_tokens: int = 0) -> None:
        super().__init__(replicas, seed)
        replicas = self.replicas  # a Python int
        balance_eps = check_balance_eps(balance_eps)
        if not is_int(min_total_prefill_tokens) or min_total_prefill_tokens < 0:
            raise InvalidInputError(f"min_total_prefill_tokens must be an int >= 0, got {min_total_prefill_tokens!r}")
        if caches is not None and (len(caches) != replicas or not all(callable(getattr(c, "peek", None))
                                                                       for c in caches)):
            raise InvalidInputError(f"caches must be {replicas} objects with a peek(tokens) method (one per "
                                    "replica, e.g. PrefixCacheCore), or None")
        self.balance_eps, self.checkpointed, self.caches = balance_eps, checkpointed, caches
        self.min_mean_tokens = int(min_total_prefill_tokens) / replicas  # the final mean is at least this
        self.tree = RadixTree()
        self.all_mask = (1 << replicas) - 1

    def sent(self, walk: Walk) -> np.ndarray:
        """Per replica: how many tokens of the walked path it was sent and is not known to have dropped (an edge
        counts only below edges it holds): an upper bound of what it holds."""
        sent = np.zeros(self.replicas, dtype=np.int64)
        alive = self.all_mask
        for node in walk.path[1:]:
            _assign(sent, alive & ~node.kv.mask, node.start, 0)
            alive &= node.kv.mask
            if not alive:
                return sent
        _assign(sent, alive, walk.shared_length, 0)
        return sent

    def reusable(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per replica: the tokens of `tokens` it is expected to resume now and the tokens it holds the KV of
        (where serving the request there checkpoints the branch). With `caches`, every replica is asked (and what
        they evicted is forgotten)."""
        tokens = as_tokens(tokens)
        walk = self.tree.walk(tokens, "default")
        if self.caches is not None:
            reusable, shared = np.zeros((2, self.replicas), dtype=np.int64)
            for replica in range(self.replicas):
                reusable[replica], shared[replica] = self._ask(tokens, walk, replica)
            return reusable, shared
        shared = self.sent(walk)
        if not self.checkpointed:
            return shared, shared
        reusable, with_ckpt = np.zeros(self.replicas, dtype=np.int64), 0
        for node in reversed(walk.path[1:]):  # the deepest checkpoint each replica was modelled to keep
            for i in range(node.checkpoint_at_or_before(walk.shared_length), -1, -1):
                with_ckpt = _assign(reusable, node.ckpt_state[i].mask & ~with_ckpt, node.ckpt_pos[i], with_ckpt)
            if with_ckpt == self.all_mask:
                break
        return reusable, shared

    def choose(self, tokens: np.ndarray) -> Choice:
        tokens = as_tokens(tokens)
        if self.caches is None:
            reusable, shared = self.reusable(tokens)
            known = np.ones(self.replicas, dtype=bool)
        else:
            reusable, shared, known = self._ask_until_decided(tokens)
        best = self._best(len(tokens), reusable, shared, known)
        if best is None:  # no replica is eligible: the least work after the request gets it
            if self.caches is not None:
                reusable, shared = self.reusable(tokens)
            best = int(np.argmin(self.loads + (len(tokens) - reusable)))
        return Choice(best, int(reusable[best]))

    def _best(self, length: int, reusable: np.ndarray, shared: np.ndarray, known: np.ndarray) -> int | None:
        """The best `known` eligible replica, or None."""
        after = self.loads + (length - reusable)  # each replica's prefill work if it takes the request
        mean_after = np.maximum((self.loads.sum() + length - reusable) / self.replicas, self.min_mean_tokens)
        eligible = np.flatnonzero(known & (after <= (1.0 + self.balance_eps) * mean_after))
        if len(eligible) == 0:
            return None
        # The most preferred (_preference), then the least work after the request, then the lowest index.
        preference = [-key[eligible] for key in reversed(_preference(length, reusable, shared))]
        order = np.lexsort((eligible, after[eligible], *preference))
        return int(eligible[order[0]])

    def _ask_until_decided(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(reusable, shared, known): the replicas asked in decreasing order of what they were sent, until the best
        eligible answer beats every bound left (a replica sent nothing of the path holds nothing of it)."""
        walk = self.tree.walk(tokens, "default")
        bound = self.sent(walk)
        reusable, shared = np.zeros((2, self.replicas), dtype=np.int64)
        known = bound == 0
        for replica in np.argsort(-bound, kind="stable")[: self.replicas - int(known.sum())].tolist():
            best = self._best(len(tokens), reusable, shared, known)
            if best is not None and _preference(len(tokens), int(reusable[best]), int(shared[best])) > (
                    int(bound[replica]),) * 3:  # each key of a replica is at most its bound
                break
            reusable[replica], shared[replica] = self._ask(tokens, walk, replica)
            known[replica] = True
        return reusable, shared, known

    def _ask(self, tokens: np.ndarray, walk: Walk, replica: int) -> tuple[int, int]:
        """What `replica`'s cache can resume of `tokens` (walked by `walk`) and how many it shares; what it was
        sent deeper than that on the path it evicted: forgotten."""
        length, shared = self.caches[replica].peek(tokens)
        if shared < walk.shared_length:  # it lacks token `shared` of the path, so everything below it
            self._forget(walk, replica, shared)
        return (length if self.checkpointed else shared), shared

    def _forget(self, walk: Walk, replica: int, depth: int) -> None:
        """`replica` holds only `depth` tokens of the walked path: clear its bit below (the edge across `depth` is
        split there, so that its bound becomes exact); `walk.path` stays the path in the changed tree."""
        bit, path = 1 << replica, walk.path
        for k in range(len(path) - 1, 0, -1):  # deepest first
            node = path[k]
            if node.end <= depth:
                break
            if node.kv.mask & bit:
                if node.start < depth:  # split keeps `node` as the lower part
                    path.insert(k, self.tree.split(node, depth, 0))
                node.kv.mask &= ~bit

    def record(self, replica: int, tokens: np.ndarray, prefill_tokens: int) -> None:
        super().record(replica, tokens, prefill_tokens)
        tokens = as_tokens(tokens)
        if len(tokens) == 0:
            return
        bit = 1 << replica
        walk = self.tree.walk(tokens, "default")
        modelled = self.caches is None and self.checkpointed  # the fallback model places checkpoints
        held = int(self.sent(walk)[replica]) if modelled else 0  # where a Marconi cache checkpoints the branch
        deepest = walk.path[-1]
        if walk.shared_length < len(tokens):
            parent = self.tree.split(deepest, walk.shared_length, 0) if walk.ends_inside_edge else deepest
            tail = tokens[walk.shared_length:].copy()
            deepest = self.tree.add_leaf(parent, tail, Holders(len(tail), 0), 0)
        elif deepest.end > len(tokens):  # the path ends inside an edge: the replica holds only its upper part
            deepest = self.tree.split(deepest, len(tokens), 0)
        for node in deepest.ancestors()[:-1]:
            node.kv.mask |= bit
        for position in {held, len(tokens)} - {0} if modelled else ():
            self._add_checkpoint(deepest, position, bit)

    def _add_checkpoint(self, deepest: Node, position: int, bit: int) -> None:
        node = deepest
        while node.start >= position:
            node = node.parent
        i = bisect.bisect_left(node.ckpt_pos, position)
        if i == len(node.ckpt_pos) or node.ckpt_pos[i] != position:
            self.tree.add_checkpoints(node, [(position, Holders(0, 0))])
        node.ckpt_state[i].mask |= bit


def _preference(length: int, reusable: np.ndarray | int, shared: np.ndarray | int) -> tuple:
    """What ranks replicas for a `length`-token request, most first: its reuse now; then what a repeat of it would
    resume there once it was served there: the branch checkpoint the request creates at `shared` where it leaves the
    held path inside its input, else only what it resumes now (a replica holding the whole input checkpoints the
    branch in the output, if at all, past where a request with this input can resume: a repeat with the same
    output, as greedy decoding gives, never resumes more there); then the most held KV (the least new KV to store)."""
    return reusable, reusable + (shared < length) * (shared - reusable), shared  # arrays or ints


def _assign(out: np.ndarray, new: int, position: int, assigned: int) -> int:
    """Set out[r] = position for every replica bit r in `new`; returns `assigned | new`."""
    bits = new
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = position
        bits ^= low
    return assigned | new


ROUTERS = {cls.name: cls for cls in (RandomRouter, RoundRobinRouter, AffinityRouter)}


def make_router(name: str, replicas: int, seed: int = 0, **options) -> Router:
    """A router by name (one of ROUTING_NAMES); `options` go to AffinityRouter (balance_eps, checkpointed,
    caches, min_total_prefill_tokens)."""
    cls = ROUTERS[check_routing(name)]
    return cls(replicas, seed, **options) if cls is AffinityRouter else cls(replicas, seed)
