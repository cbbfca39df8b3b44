"""dp's alpha adapted online from the evictions the cache comes to regret: no replays.

Marconi tunes alpha once by replaying its bootstrap window for every alpha of a grid (eviction.py AlphaBootstrap),
a one-off cost of 21 window replays. `RegretThinning` (dp with `alpha=None`) instead keeps a bounded record of
ghosts, as LeCaR and ARC keep the history of what they evicted: each state an eviction dropped, keyed by a hash of
the token prefix it was the state of, with where its victim stood among the candidates when it was picked: its
min-max normalised recency and FLOP efficiency, the two terms of the score recency + alpha * efficiency. A victim
pure recency would pick is old (recency near 0); one the efficiency term pushed out is inefficient.

A later request that resumes short of a ghost it shares the prefix of regrets that eviction: it recomputes the
tokens between, FLOPs the ghost's state would have saved. The blame goes to the expert that wanted the victim out:
recency (alpha = 0) by 1 - recency, efficiency by 1 - efficiency; alpha moves toward the other one, by the learning
rate times the share of the request's prefill FLOPs that was lost times (efficiency - recency), within [0, 2]
(Marconi's grid). One hash pass over the request's input and a dict look-up per remembered depth in range: no
replays, and nothing at all until the first eviction.
"""

from __future__ import annotations

import bisect
import copy

import numpy as np

from prefixlab.cache.eviction import ThinningFlopAware
from prefixlab.cache.tree import Node

ALPHA_MAX = 2.0  # the top of Marconi's grid


def _same_prefix(tokens: np.ndarray, edges: list[np.ndarray], depth: int) -> bool:
    """Whether tokens[:depth] is the concatenation of `edges` cut at `depth` (byte compares, edge by edge)."""
    done = 0
    for edge in edges:
        n = min(len(edge), depth - done)
        if tokens[done:done + n].tobytes() != edge[:n].tobytes():
            return False
        done += n
        if done == depth:
            return True
    return False


class Ghosts:
    """The states the last `max_ghosts` evictions dropped (a ring): depth, the token before it and the path of
    edges (token arrays, never modified) to it, with the victim's (recency, efficiency) when it was picked,
    normalised over the candidates. A request's look-up filters them by depth range and token in numpy, then
    compares the few left exactly."""

    def __init__(self, max_ghosts: int) -> None:
        self.max_ghosts, self.count = max_ghosts, 0
        self._depths = np.zeros(max_ghosts, dtype=np.int64)  # 0: an empty slot
        self._lasts = np.zeros(max_ghosts, dtype=np.int64)
        self._paths: list[tuple | None] = [None] * max_ghosts  # (namespace, edges, standing)
        self._next = 0

    def __len__(self) -> int:
        return self.count

    def copy(self) -> Ghosts:
        twin = copy.copy(self)
        twin._depths, twin._lasts, twin._paths = self._depths.copy(), self._lasts.copy(), list(self._paths)
        return twin

    def add(self, namespace: str, edges: list[np.ndarray], depth: int, standing: tuple[float, float]) -> None:
        """The state at `depth` of the path `edges` (root first) was evicted."""
        done = 0
        for edge in edges:  # the token before `depth`
            if done + len(edge) >= depth:
                break
            done += len(edge)
        slot = self._next
        self.count += not self._depths[slot]
        self._depths[slot], self._lasts[slot] = depth, edge.item(depth - 1 - done)
        self._paths[slot] = (namespace, edges, standing)
        self._next = (slot + 1) % self.max_ghosts

    def deepest(self, namespace: str, tokens: np.ndarray, low: int, high: int) -> tuple[int, tuple] | None:
        """The deepest ghost at a depth in (low, high] whose prefix is tokens[:depth], removed: (depth, standing)."""
        depths = self._depths
        slots = np.flatnonzero((depths > low) & (depths <= high))
        if not len(slots):
            return None
        slots = slots[tokens[depths[slots] - 1] == self._lasts[slots]]
        for slot in slots[np.argsort(-depths[slots], kind="stable")].tolist():
            depth = int(depths[slot])
            ghost_namespace, edges, standing = self._paths[slot]
            if ghost_namespace == namespace and _same_prefix(tokens, edges, depth):
                self._depths[slot], self._paths[slot] = 0, None
                self.count -= 1
                return depth, standing
        return None


class RegretThinning(ThinningFlopAware):
    """dp's eviction with alpha adapted online (module docstring): starts at `alpha`, never replays."""

    def __init__(self, *args, rate: float = 1.0, max_ghosts: int = 1024, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rate = rate
        self.ghosts = Ghosts(max_ghosts)
        self.shadows: dict[int, int] = {}  # node id -> +1: recency wanted it out, -1: efficiency did, 0: both
        self.regrets = 0  # requests that resumed short of a ghost
        self._now = 0

    def copy_for(self, tree, nodes) -> RegretThinning:
        twin = super().copy_for(tree, nodes)
        twin.ghosts, twin.shadows = self.ghosts.copy(), dict(self.shadows)
        return twin

    def forget(self, node: Node) -> None:
        super().forget(node)
        self.shadows.pop(node.id, None)

    def pick(self, now: int) -> Node | None:
        """FLOP-aware pick; the oldest and the least efficient unlocked candidates, if spared, are marked: a
        later resume from one of them is what evicting it would have lost (the expert that wanted it out)."""
        self._now = now
        victim = super().pick(now)
        if victim is not None:
            nodes = self.nodes
            oldest = next((i for *_, i in self.by_recency if nodes[i].lock_count == 0), None)
            poorest = next((i for _, i in self.by_efficiency if nodes[i].lock_count == 0), None)
            for node_id, sign in ((oldest, 1), (poorest, -1)):
                if node_id is not None and node_id != victim.id:
                    old = self.shadows.get(node_id)
                    self.shadows[node_id] = sign if old is None or old == sign else 0
        return victim

    def standing(self, node: Node) -> tuple[float, float]:
        """(recency, efficiency) of candidate `node`, each min-max normalised over the candidates (0: the oldest,
        the least efficient; all-equal values normalise to 1, as in `pick`)."""
        now = self._now
        low, high = 1.0 / (now - self.by_recency.first()[0]), 1.0 / (now - self.by_recency.last()[0])
        recency = (1.0 / (now - node.last_access) - low) / (high - low) if high > low else 1.0
        low, high = self.by_efficiency.first()[0], self.by_efficiency.last()[0]
        efficiency = (self.efficiency[node.id] - low) / (high - low) if high > low else 1.0
        return recency, efficiency

    def free(self, node: Node, want_bytes: int) -> int:
        """Evict as dp does; the deepest state it drops becomes a ghost."""
        before = list(node.ckpt_pos)
        if not before:
            return super().free(node, want_bytes)
        standing, edges = self.standing(node), [n.tokens for n in reversed(node.ancestors())]
        freed = super().free(node, want_bytes)
        kept = set(node.ckpt_pos)
        dropped = [p for p in before if p not in kept]
        if dropped:
            self.ghosts.add(node.namespace, edges, dropped[-1], standing)
        return freed

    def _share(self, tokens: np.ndarray, low: int, high: int) -> float:
        """Prefill FLOPs of tokens[low:high] over those of the whole input."""
        linear, pair, n, total = self._linear_flops, self._pair_flops, float(high - low), float(len(tokens))
        return (linear * n + pair * n * (2.0 * low + n)) / max(linear * total + pair * total * total, 1e-30)

    def observe(self, tokens: np.ndarray, namespace: str, resumed: int, node: Node) -> None:
        if not self.ghosts:
            return
        sign = self.shadows.pop(node.id, None) if resumed else None
        if sign:  # resumed from a spared node one expert wanted out: it would have lost what this saved
            positions = node.ckpt_pos
            below = positions[bisect.bisect_left(positions, resumed) - 1] if positions[0] < resumed else node.start
            self._move(sign * self._share(tokens, below, resumed))
        found = self.ghosts.deepest(namespace, tokens, resumed, len(tokens))
        if found is not None:  # resumed short of a ghost: its eviction is regretted
            depth, (recency, efficiency) = found
            self.regrets += 1
            self._move(self._share(tokens, resumed, depth) * (efficiency - recency))

    def _move(self, step: float) -> None:
        """Toward efficiency (step > 0: recency lost) or recency."""
        self.alpha = min(max(self.alpha + self.rate * step, 0.0), ALPHA_MAX)
