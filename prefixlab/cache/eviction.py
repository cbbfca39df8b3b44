"""Eviction policies: which unlocked part of the tree to free next.

Each policy keeps its candidates in sorted indexes, updated from the tree's change notifications, so picking a
victim never scans the tree:
- `LeafLRU` (sglang+): the least recently used leaf goes, KV and checkpoints;
- `BlockLRU` (vllm+): the tail block (from its previous checkpoint) of the least recently used leaf goes;
- `FlopAware` (marconi; dp's `ThinningFlopAware` adds thinning moves): Marconi's utility S = recency + alpha *
  flop_efficiency over nodes with <= 1 child,
  both min-max normalised over the candidates; a leaf is deleted, a single-child node drops its checkpoints and
  its KV merges into the child. The argmin is found with a threshold scan over the two sorted indexes, which
  stops as soon as no unseen candidate can score lower.
"""

from __future__ import annotations

import bisect
import copy
import math

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.sorted_index import SortedIndex
from prefixlab.cache.tree import Node, RadixTree
from prefixlab.cache.weighted_pick import pick_weighted, resume_boosts


class EvictionPolicy:
    """Base: tracks eligible nodes by recency; subclasses say what is eligible and how a victim is freed."""

    def __init__(self, tree: RadixTree, spec: ModelSpec, block_size: int) -> None:
        self.tree, self.spec, self.block_size = tree, spec, block_size
        self.hybrid = spec.state_bytes > 0
        self.nodes: dict[int, Node] = {}
        self.by_recency = SortedIndex()

    def copy_for(self, tree: RadixTree, nodes: dict[int, Node]) -> EvictionPolicy:
        """This policy's state over `tree`, a copy of its tree whose nodes by id are `nodes` (RadixTree.copy)."""
        twin = copy.copy(self)
        twin.tree, twin.nodes, twin.by_recency = tree, {i: nodes[i] for i in self.nodes}, self.by_recency.copy()
        return twin

    def eligible(self, node: Node) -> bool:
        """Whether the node's shape makes it a candidate (locked candidates stay indexed and are skipped)."""
        return node.parent is not None and not node.children

    def update(self, node: Node) -> None:
        if self.eligible(node):
            self.nodes[node.id] = node
            # Ties: the deeper entry first, as vLLM frees longer prefixes first.
            self.by_recency.put(node.id, (node.last_access, -node.end))
        else:
            self.remove(node)

    def remove(self, node: Node) -> None:
        self.nodes.pop(node.id, None)
        self.by_recency.discard(node.id)

    def forget(self, node: Node) -> None:
        """`node` left the tree."""
        self.remove(node)

    def link(self, admission: object) -> None:
        """Called with the admission policy it is paired with (after construction and after a fork)."""

    def pick(self, now: int) -> Node | None:
        """The unlocked candidate to evict next, or None."""
        for *_, node_id in self.by_recency:
            if self.nodes[node_id].lock_count == 0:
                return self.nodes[node_id]
        return None

    def thins(self, node: Node) -> bool:
        """Whether `free(node)` would drop only some of its states and keep the entry (dp's thinning)."""
        return False

    def free(self, node: Node, want_bytes: int) -> int:
        """Evict (part of) the picked `node`; `want_bytes` is how much is still needed. Returns bytes freed."""
        return self.tree.remove_leaf(node)

    def resumed_from(self, node: Node, now: int) -> None:
        """A request resumed from the state at the end of `node`, a branch point, at clock `now`."""

    def drop_state(self, node: Node, index: int) -> int:
        """Drop `node`'s state `index` alone (the core's strict-budget thinning of a locked path); bytes freed."""
        return self.tree.drop_checkpoints(node, index, index + 1)


class LeafLRU(EvictionPolicy):
    """sglang+: least recently used leaf, whole."""


class BlockLRU(EvictionPolicy):
    """vllm+: the last block of the least recently used leaf (a block ends at a checkpoint; KV-only models use
    `block_size`-token blocks)."""

    def free(self, node: Node, want_bytes: int) -> int:
        # Blocks of one leaf share its timestamp, so LRU takes them tail first: cut the fewest that free enough.
        if self.hybrid:
            cuts = [p for p in node.ckpt_pos if p < node.end]
        else:
            cuts = list(range((node.start // self.block_size + 1) * self.block_size, node.end, self.block_size))

        def too_little(i: int) -> bool:  # cutting at cuts[i] frees less than wanted (true for a suffix of cuts)
            states_after = sum(s.nbytes for s in node.ckpt_state[bisect.bisect_right(node.ckpt_pos, cuts[i]):])
            # (KV bytes are linear in the tokens: no split, which copies a real model's KV at every probe)
            kv_after = node.kv.nbytes * (node.end - cuts[i]) // node.kv.ntokens if node.kv is not None else 0
            return states_after + kv_after < want_bytes

        enough = bisect.bisect_left(range(len(cuts)), True, key=too_little)  # cuts[:enough] free enough
        return self.tree.trim_tail(node, cuts[enough - 1]) if enough else self.tree.remove_leaf(node)


class FlopAware(EvictionPolicy):
    """Marconi: minimise recency + alpha * flop_efficiency over unlocked nodes with <= 1 child.

    recency = 1 / (now - last_access) and flop_efficiency = FLOPs the node's checkpoints save over its parent
    (the prefill of its edge up to its deepest checkpoint) per byte its eviction frees; both are min-max
    normalised over the candidates (all-equal values normalise to 1, as in Marconi)."""

    alpha_ties = "smallest"  # Marconi's tuner keeps the smallest of the alphas whose replays tie
    provisional_grid: tuple[float, ...] | None = None  # Marconi tunes once (alpha.py)
    # set by the alpha tuner in its window replays: other alphas whose picks were this one's at every eviction so
    # far (their replays would be this one, decision for decision: alpha plays no other part)
    alike: set[float] | None = None

    def __init__(self, tree: RadixTree, spec: ModelSpec, block_size: int, alpha: float = 0.0) -> None:
        super().__init__(tree, spec, block_size)
        self.alpha = alpha
        self._max_children = 1 if self.hybrid else 0  # KV-only trees merge single-child nodes eagerly
        self._linear_flops, self._pair_flops = spec.linear_flops_per_token, spec.pair_flops
        self.by_efficiency = SortedIndex()
        self.efficiency: dict[int, float] = {}
        self._shapes: dict[int, tuple] = {}

    def copy_for(self, tree: RadixTree, nodes: dict[int, Node]) -> FlopAware:
        twin = super().copy_for(tree, nodes)
        twin.by_efficiency, twin.efficiency, twin._shapes = self.by_efficiency.copy(), dict(self.efficiency), dict(
            self._shapes)
        return twin

    def eligible(self, node: Node) -> bool:
        return node.parent is not None and len(node.children) <= self._max_children

    def flop_efficiency(self, node: Node) -> float:
        freed = node.state_bytes + (0 if node.children else node.kv_bytes)
        new = float((node.ckpt_pos[-1] if node.ckpt_pos else node.end) - node.start)
        # spec.prefill_flops(new, node.start), the same float expression without its argument checks (hot path)
        saved = self._linear_flops * new + self._pair_flops * new * (2.0 * node.start + new)
        return saved / max(freed, 1)

    def update(self, node: Node) -> None:  # EvictionPolicy.update and the efficiency index, in one (hot path)
        node_id = node.id
        if not self.eligible(node):
            if node_id in self.nodes:  # (a node is in every index or in none)
                self.remove(node)
            return
        self.nodes[node_id] = node
        start, length, positions = node.start, len(node.tokens), node.ckpt_pos
        self.by_recency.put(node_id, (node.last_access, -(start + length)))
        # Locks and timestamps change far more often than what the efficiency depends on.
        # (stored states never change size, so their count and the deepest position pin the freed bytes)
        shape = (start, length, len(positions), positions[-1] if positions else 0, not node.children)
        cached = self._shapes.get(node_id)
        if cached is None or cached[0] != shape:
            cached = self._shapes[node_id] = (shape, self.flop_efficiency(node))
        elif node_id in self.efficiency:
            return  # indexed with this efficiency already (efficiency and _shapes always agree)
        self.efficiency[node_id] = cached[1]
        self.by_efficiency.put(node_id, (cached[1],))

    def remove(self, node: Node) -> None:
        super().remove(node)
        self.efficiency.pop(node.id, None)
        self.by_efficiency.discard(node.id)

    def forget(self, node: Node) -> None:
        self.remove(node)
        self._shapes.pop(node.id, None)

    def pick(self, now: int) -> Node | None:
        victim = self._pick(now)
        if self.alike:  # the alpha tuner's replay: keep only the alphas that would evict the same victim
            alpha = self.alpha
            for other in tuple(self.alike):
                self.alpha = other
                if self._pick(now) is not victim:
                    self.alike.discard(other)
            self.alpha = alpha
        return victim

    def _pick(self, now: int) -> Node | None:
        """`pick` under the current alpha."""
        if len(self.nodes) <= 1 or self.alpha == 0:
            return super().pick(now)
        now = max(now, self.by_recency.last()[0] + 1)  # ages >= 1 (the core's clock has moved; a caller's may not)
        # Min-max normalisation (over all candidates, locked ones included, as Marconi scores every node) is
        # affine, so comparing recency * recency_scale + efficiency * eff_scale ranks like S does.
        recency_low, recency_high = 1.0 / (now - self.by_recency.first()[0]), 1.0 / (now - self.by_recency.last()[0])
        eff_low, eff_high = self.by_efficiency.first()[0], self.by_efficiency.last()[0]
        recency_scale = 1.0 / (recency_high - recency_low) if recency_high > recency_low else 0.0
        eff_scale = self.alpha / (eff_high - eff_low) if eff_high > eff_low else 0.0
        nodes, efficiency = self.nodes, self.efficiency
        best_score, best_id, seen = float("inf"), None, set()
        seen_add = seen.add
        # Row by row: the next oldest candidate (keyed by its timestamp), then the next least efficient one. A
        # locked candidate is marked seen too: it is skipped whenever it comes up.
        for (last_access, _, old_id), (eff, inefficient_id) in zip(self.by_recency, self.by_efficiency, strict=True):
            if old_id not in seen:
                seen_add(old_id)
                if nodes[old_id].lock_count == 0:
                    score = 1.0 / (now - last_access) * recency_scale + efficiency[old_id] * eff_scale
                    if score < best_score:
                        best_score, best_id = score, old_id
            if inefficient_id not in seen:
                seen_add(inefficient_id)
                node = nodes[inefficient_id]
                if node.lock_count == 0:
                    score = 1.0 / (now - node.last_access) * recency_scale + eff * eff_scale
                    if score < best_score:
                        best_score, best_id = score, inefficient_id
            # Every unseen candidate is at least as old and as inefficient as the current rows of both indexes.
            if best_score <= recency_scale / (now - last_access) + eff_scale * eff:
                break
        return self.nodes[best_id] if best_id is not None else None

    def free(self, node: Node, want_bytes: int) -> int:
        return self.tree.remove_leaf(node) if not node.children else self.tree.dissolve(node)


class ThinningFlopAware(FlopAware):
    """dp: Marconi's FLOP-aware eviction (same alpha, same scores for whole entries) plus thinning moves.

    Marconi's states sit at edge ends (branch points, last tokens); dp places its states inside edges. A node
    holding such interior states is a candidate whatever its children; its efficiency is that of its least
    valuable interior state: the FLOPs it saves over the state before it times the expected overlaps per entry
    that resume from it (the admission's law), per byte. Picked, it loses interior states, least valuable first,
    until enough bytes are free. A node without interior states is evicted as Marconi does (a leaf deleted, a
    single-child node dissolved), so on a tree without placed states this is Marconi's eviction, except that an
    entry's leaf has its utility (efficiency and recency, weighted_pick.py) times the admission's
    `law.leaf_weight()` (1 unless leaves are resumed from less often than stored nodes on the whole: then the long
    leaves of never-repeated queries go before the short branch points many requests resume from), and a branch
    point resumed from more than once lately has its recency times 1 + ln(its resumes, each decayed by the law's
    decay per tick of the core's clock: about two a request, a match and an admission), so a burst of one-off
    entries does not push a prompt in steady use out of a small cache."""

    admission = None
    _last_values: tuple[Node, list[float]] | None = None  # the node flop_efficiency last valued, and its values
    leaf_weight = 1.0  # the admission's `law.leaf_weight` when the index was last built (see `pick`)
    # dp's window replays often tie over a wide range of alphas (the window is too short for all but the lowest
    # to make a difference); the smallest of them is the closest to those that lost, the middle the farthest
    alpha_ties = "middle"
    # a first tuning at 2 x N0 requests on this coarse grid, the final one at 5 x N0 on Marconi's (alpha.py)
    provisional_grid = (0.0, 0.2, 0.5, 1.0, 2.0)

    def __init__(self, tree: RadixTree, spec: ModelSpec, block_size: int, alpha: float = 0.0) -> None:
        super().__init__(tree, spec, block_size, alpha)
        self.leaf_recency = SortedIndex()  # the candidates weighed by leaf_weight (entries' leaves), by recency
        # the candidates with recent resumes (see `resumed_from`), each with ln(its resumes decayed to clock 0):
        # ln(resumes decayed to now) is that minus now * ln(1 / decay), a subtraction per candidate and pick
        self.boosted: dict[int, float] = {}

    def copy_for(self, tree: RadixTree, nodes: dict[int, Node]) -> ThinningFlopAware:
        twin = super().copy_for(tree, nodes)
        twin.leaf_recency, twin.boosted = self.leaf_recency.copy(), dict(self.boosted)
        return twin

    def resumed_from(self, node: Node, now: int) -> None:
        # A branch point's recency term is boosted by its resumes, decayed per clock tick (weighted_pick.py)
        if self.admission is not None:
            decayed = node.recent_resumes * self.admission.law.decay ** (now - node.resumed_at)
            node.recent_resumes, node.resumed_at = decayed + 1.0, now
            if node.id in self.nodes:
                self.boosted[node.id] = self._log_at_zero(node)

    def _log_at_zero(self, node: Node) -> float:
        """ln(the node's recent resumes decayed back to clock 0): see `boosted`."""
        return math.log(node.recent_resumes) - node.resumed_at * math.log(self.admission.law.decay)

    def _boosts(self, now: int) -> dict[int, float]:
        """The candidates' recency factors now (weighted_pick.resume_boosts); forgotten resumes are dropped."""
        boosts, forgotten = resume_boosts(self.boosted, now * -math.log(self.admission.law.decay))
        for node_id in forgotten:
            self.nodes[node_id].recent_resumes = 0.0
            del self.boosted[node_id]
        return boosts

    def link(self, admission: object) -> None:
        self.admission = admission
        admission.tree = self.tree  # the admission prices states by how full this tree is

    def update(self, node: Node) -> None:
        node_id, admission = node.id, self.admission
        if admission is not None and admission.track(node) and self.leaf_weight != 1.0:
            self._shapes.pop(node_id, None)  # whether it is an entry's leaf changed its efficiency
        FlopAware.update(self, node)  # (not super(): Python 3.11 builds a super object a call, hot path)
        indexed = node_id in self.nodes
        if node.recent_resumes and indexed:
            if node_id not in self.boosted:  # (resumed_from keeps a boosted node's entry current)
                self.boosted[node_id] = self._log_at_zero(node)
        else:
            self.boosted.pop(node_id, None)
        if self.leaf_weight != 1.0:  # the weighted leaves' recency index is kept while a weight applies (see pick)
            # (_weighted inlined, hot path: an entry's leaf whose one state is at its end)
            if indexed and admission.shape_of(node) == 0 and node.ckpt_pos[0] >= node.start + len(node.tokens):
                self.leaf_recency.put(node_id, (node.last_access, -node.end))
            else:
                self.leaf_recency.discard(node_id)

    def _weighted(self, node: Node) -> bool:
        """An entry's leaf without in-edge states: its utility is weighed by the admission's leaf_weight."""
        return self.admission.shape_of(node) == 0 and not self.thins(node)

    def remove(self, node: Node) -> None:
        super().remove(node)
        self.leaf_recency.discard(node.id)
        self.boosted.pop(node.id, None)

    def _pick(self, now: int) -> Node | None:
        # entries' leaves are weighed by how likely they are resumed from (flop_efficiency); when that moved, they
        # are re-indexed (one weight for the whole index)
        weight = self.admission.law.leaf_weight() if self.admission is not None else 1.0
        if weight != self.leaf_weight:
            scale, self.leaf_weight, self.leaf_recency = weight / self.leaf_weight, weight, SortedIndex()
            efficiencies, recencies = {}, {}  # (re-indexed in one sort each: a put per node is quadratic)
            for node_id, node in self.nodes.items():
                if self._weighted(node):  # indexed with the old weight
                    efficiency = self.efficiency[node_id] = self.efficiency[node_id] * scale
                    efficiencies[node_id] = (efficiency,)
                    self._shapes[node_id] = (self._shapes[node_id][0], efficiency)
                    if weight != 1.0:
                        recencies[node_id] = (node.last_access, -node.end)
            self.by_efficiency.put_many(efficiencies)
            self.leaf_recency.put_many(recencies)
        if self.nodes:  # ages >= 1 (as FlopAware's and pick_weighted's), and the boosts decayed to the same now
            now = max(now, self.by_recency.last()[0] + 1)
        boosts = self._boosts(now) if self.boosted else {}
        if (weight == 1.0 and not boosts) or len(self.nodes) <= 1:
            return super()._pick(now)
        best = pick_weighted(now, self.nodes, self.by_recency, self.leaf_recency, weight, self.by_efficiency,
                             self.efficiency, self.alpha, boosts)
        return self.nodes[best] if best is not None else None

    def eligible(self, node: Node) -> bool:
        if node.parent is None:
            return False
        return len(node.children) <= self._max_children or (bool(node.ckpt_pos) and node.ckpt_pos[0] < node.end)

    def forget(self, node: Node) -> None:
        super().forget(node)
        if self.admission is not None:
            self.admission.forget(node)

    def _interior_values(self, node: Node) -> list[float]:
        """Expected FLOPs per entry each interior state (those before the edge's end) saves over the one before."""
        positions, start = node.ckpt_pos, node.start
        count = bisect.bisect_left(positions, start + len(node.tokens))  # the states before the edge's end
        if not count:
            return []
        linear, pair, values = self._linear_flops, self._pair_flops, []
        for i, mass in enumerate(self.admission.overlap_masses(node, count)):
            below = positions[i - 1] if i else start
            new = float(positions[i] - below)
            values.append(mass * (linear * new + pair * new * (2.0 * below + new)))
        return values

    def flop_efficiency(self, node: Node) -> float:
        positions = node.ckpt_pos  # (most nodes hold no interior state: not valued then, hot path)
        interior = positions and positions[0] < node.start + len(node.tokens) and self.admission is not None
        values = self._interior_values(node) if interior else []
        self._last_values = (node, values)  # `free` reads them back after each state it drops
        if values:
            return min(values) / max(node.ckpt_state[0].nbytes, 1)
        whole = FlopAware.flop_efficiency(self, node)  # (as in update; a weight of 1 needs no shape looked up)
        return whole * self.leaf_weight if self.leaf_weight != 1.0 and self.admission.shape_of(node) == 0 else whole

    def thins(self, node: Node) -> bool:
        return self.admission is not None and bool(node.ckpt_pos) and node.ckpt_pos[0] < node.end

    def free(self, node: Node, want_bytes: int) -> int:
        if self.admission is None:
            return super().free(node, want_bytes)
        # a lone interior state goes whatever its value: it is not valued (most thinned nodes hold one)
        count = bisect.bisect_left(node.ckpt_pos, node.end)
        freed, values = 0, self._interior_values(node) if count > 1 else [0.0] * count
        while freed < want_bytes and values:
            cheapest = values.index(min(values))
            self._last_values = None
            freed += self.tree.drop_checkpoints(node, cheapest, cheapest + 1)
            # the drop re-indexed the node (update -> flop_efficiency) with its values for its new shape, and
            # nothing the values depend on (the admission's law) changes within an eviction
            last = self._last_values
            values = last[1] if last is not None and last[0] is node else self._interior_values(node)
        if freed or len(node.children) > self._max_children:
            return freed
        return super().free(node, want_bytes)

