"""Request routers for a fleet of replicas, each with its own prefix cache.

    router = make_router("affinity", replicas=8)
    choice = router.choose(input_tokens)            # replica and the prefix it is expected to resume
    ...serve on choice.replica, reusing `hit` tokens...
    router.record(choice.replica, input_and_output_tokens, prefill_tokens=len(input_tokens) - hit)

`random` and `round-robin` ignore prefixes. `affinity` keeps a radix tree of what each replica was sent (a bit
mask of replicas per edge and per checkpoint) and sends a request where the longest prefix can be *resumed*: for a
hybrid model the deepest recurrent checkpoint on the shared path, not the longest KV match. The router models
each replica as a Marconi-style cache (a checkpoint where a sequence branched off what the replica held, and one
at its last token) that never evicts: an approximation, the replicas' own policies decide what they really keep.
Balance is a constraint: a replica is eligible only if its prefill work after the request stays within
(1 + balance_eps) x the fleet mean plus the request's own length (slack, so that early requests can reuse at all);
when none is, the least-loaded one gets it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from prefixlab.cache.tokens import as_tokens
from prefixlab.cache.tree import Node, RadixTree
from prefixlab.errors import InvalidInputError

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


def check_routing(name: str) -> str:
    if name not in ROUTING_NAMES:
        raise InvalidInputError(f"routing {name!r} is unknown; use one of {', '.join(ROUTING_NAMES)}")
    return name


class Router:
    """Shared bookkeeping: predicted prefill tokens per replica (`loads`). Subclasses pick the replica."""

    name = ""

    def __init__(self, replicas: int, seed: int = 0) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InvalidInputError(f"replicas must be a positive int, got {replicas!r}")
        self.replicas = replicas
        self.loads = np.zeros(replicas, dtype=np.int64)
        self.rng = np.random.default_rng(seed)

    def choose(self, tokens: np.ndarray) -> Choice:
        raise NotImplementedError

    def record(self, replica: int, tokens: np.ndarray, prefill_tokens: int) -> None:
        """`replica` served `tokens` (input, or input + output when known), computing `prefill_tokens` of them."""
        if isinstance(replica, bool) or not isinstance(replica, int | np.integer) or not 0 <= replica < self.replicas:
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


class AffinityRouter(Router):
    """Longest resumable prefix under a balance constraint (see the module docstring).

    `checkpointed=False` models KV-only replicas (any shared token is reusable)."""

    name = "affinity"

    def __init__(self, replicas: int, seed: int = 0, *, balance_eps: float = 0.15, checkpointed: bool = True) -> None:
        super().__init__(replicas, seed)
        if not isinstance(balance_eps, int | float) or not balance_eps >= 0:
            raise InvalidInputError(f"balance_eps must be a number >= 0, got {balance_eps!r}")
        self.balance_eps, self.checkpointed = float(balance_eps), checkpointed
        self.tree = RadixTree()
        self.all_mask = (1 << replicas) - 1

    def reusable(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per replica: the tokens of `tokens` it is expected to resume now (deepest checkpoint it holds on the
        path) and the tokens it holds the KV of (where serving the request there checkpoints the branch)."""
        walk = self.tree.walk(as_tokens(tokens), "default")
        reusable = np.zeros(self.replicas, dtype=np.int64)
        shared = np.zeros(self.replicas, dtype=np.int64)
        with_ckpt = with_kv = 0
        for node in reversed(walk.path[1:]):
            with_kv = _assign(shared, node.kv.mask & ~with_kv, min(node.end, walk.shared_length), with_kv)
            if self.checkpointed:
                for i in range(node.checkpoint_at_or_before(walk.shared_length), -1, -1):
                    with_ckpt = _assign(reusable, node.ckpt_state[i].mask & ~with_ckpt, node.ckpt_pos[i], with_ckpt)
            if with_kv == self.all_mask and (with_ckpt == self.all_mask or not self.checkpointed):
                break
        return (reusable if self.checkpointed else shared), shared

    def choose(self, tokens: np.ndarray) -> Choice:
        tokens = as_tokens(tokens)
        reusable, shared = self.reusable(tokens)
        after = self.loads + (len(tokens) - reusable)  # each replica's prefill work if it takes the request
        mean_after = (self.loads.sum() + len(tokens) - reusable) / self.replicas
        # The bound has one request of slack: early on (mean ~ one request) it would otherwise forbid any reuse.
        eligible = np.flatnonzero(after <= (1.0 + self.balance_eps) * mean_after + len(tokens))
        if len(eligible) == 0:
            best = int(np.argmin(after))
            return Choice(best, int(reusable[best]))
        # Most reuse now, then the most held KV (the branch checkpoint it gets there serves the next such request),
        # then the least work after the request, then the lowest index (deterministic).
        order = np.lexsort((eligible, after[eligible], -shared[eligible], -reusable[eligible]))
        best = int(eligible[order[0]])
        return Choice(best, int(reusable[best]))

    def record(self, replica: int, tokens: np.ndarray, prefill_tokens: int) -> None:
        super().record(replica, tokens, prefill_tokens)
        tokens = as_tokens(tokens)
        if len(tokens) == 0:
            return
        bit = 1 << replica
        walk = self.tree.walk(tokens, "default")
        held = 0  # how deep `replica` already held this path: where a Marconi cache checkpoints the branch
        for node in walk.path[1:]:
            if not node.kv.mask & bit:
                break
            held = min(node.end, walk.shared_length)
        deepest = walk.path[-1]
        if walk.shared_length < len(tokens):
            parent = self.tree.split(deepest, walk.shared_length, 0) if walk.ends_inside_edge else deepest
            tail = tokens[walk.shared_length:].copy()
            deepest = self.tree.add_leaf(parent, tail, Holders(len(tail), 0), 0)
        elif deepest.end > len(tokens):  # the path ends inside an edge: the replica holds only its upper part
            deepest = self.tree.split(deepest, len(tokens), 0)
        for node in deepest.ancestors()[:-1]:
            node.kv.mask |= bit
        for position in {held, len(tokens)} - {0}:
            self._add_checkpoint(deepest, position, bit)

    def _add_checkpoint(self, deepest: Node, position: int, bit: int) -> None:
        node = deepest
        while node.start >= position:
            node = node.parent
        i = bisect.bisect_left(node.ckpt_pos, position)
        if i == len(node.ckpt_pos) or node.ckpt_pos[i] != position:
            self.tree.add_checkpoints(node, [(position, Holders(0, 0))])
        node.ckpt_state[i].mask |= bit


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
    """A router by name (one of ROUTING_NAMES); `options` go to AffinityRouter (balance_eps, checkpointed)."""
    cls = ROUTERS[check_routing(name)]
    return cls(replicas, seed, **options) if cls is AffinityRouter else cls(replicas, seed)
