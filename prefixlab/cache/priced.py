"""dp: where inside an entry to keep recurrent states, priced against what the bytes would buy as KV.

The overlap law (`EntryLaw`) is where requests leave entries. A request that leaves the tree strictly inside an
edge (a first divergence there: once an edge is split, Marconi's branch-point state serves that depth) adds its
depth from the edge's start to one histogram and its distance to the edge's end to another, whether or not a
placed state caught it; a split keeps the upper edge's start, so a point where requests keep diverging keeps its
depth. A request continuing a leaf from its end (a next chat or agent turn) is served by the end state and adds
nothing; one whose whole input is shared counts as a prompt repeat. Laws are kept per entry kind ("extend": the
entry continues a leaf, "branch": anything else), counts decay by `decay` per request so the law follows drift,
and everything is normalised per admitted entry of the kind.

`PricedAdmission` adds to Marconi's branch point and last token:
- the sparse-prefix-caching DP's states (depths from the start): its cost curve `F_m` (expected recomputed tokens
  per entry with m states, for this entry's length, `PlacementTable`) values the m-th state at
  `F_{m-1} - F_m`, and states are kept while that beats the price;
- the one state at a distance from the end that saves the most (prompt + question entries are left at the
  prompt's end, a near-constant distance from the entry's end), if its saving beats the price;
- a state at the input's end when prompts repeat, if its saving beats the price;
- while states cost nothing (nothing stored reused yet) and no overlap was seen, `prior_states` evenly spaced
  states (a uniform prior: a long document's second question is caught before any law exists).
The price of a state is the KV tokens its bytes would hold times what a stored token yields (reused / (reused +
computed) tokens, decayed), divided by how well placed states' predicted savings came true so far. So dp places
states while they pay and none when every byte earns more as KV. `ThinningFlopAware` (eviction.py) drops an
entry's least valuable in-edge states before whole entries.

The law also counts stints (`track`): the time a state-holding node keeps one shape (an entry's leaf, an inner
node, a split's upper part as leaf or inner), and whether a request resumed from its states meanwhile. Where
entries' leaves are resumed from less often than stored nodes on the whole (few-shot prompts: each ends in a
unique query; prompt + question entries), `leaf_weight` < 1 discounts a leaf's FLOP efficiency in eviction:
Marconi's efficiency counts the FLOPs a hit would save, not how likely the hit is. The weight prices a leaf's
end (a leaf holding in-edge states is valued by them, thinning), so a leaf resumed from a state short of its end
counts as a resumed stored node, not a resumed leaf: what was reused is the prefix above that state, which the
request's split makes a stored node (a re-admitted system prompt in its first entry's leaf, in a small cache).
"""

from __future__ import annotations

import copy

from prefixlab.cache.admission import MarconiAdmission
from prefixlab.cache.law import ENTRY_KINDS, EntryLaw
from prefixlab.cache.placement import balanced_positions
from prefixlab.cache.tree import Node, RadixTree, Walk

_ID_CONTAINERS = frozenset(("_kinds", "_stint_shapes", "_resumed", "_resumed_inside"))  # of ints and strings


class PricedAdmission(MarconiAdmission):
    """dp: Marconi's branch point and last token, plus the DP's states inside the new entry while each one's
    expected saving beats its price, plus a state at the input end when prompts repeat."""

    def __init__(self, block: int, decay: float, resolve_every: int, state_tokens: float,
                 tree: RadixTree | None = None, capacity_bytes: int = 0, max_len: int = 1 << 15,
                 prior_states: int = 4, token_bytes: int = 0) -> None:
        self.tree, self.capacity_bytes, self.prior_states = tree, capacity_bytes, max(int(prior_states), 1)
        self.token_bytes = token_bytes  # KV bytes per token; 0: unknown, or entries are never cut (overflow)
        self.law = EntryLaw(max_len, block, decay, resolve_every)  # all requests: pressure, prompt repeats
        self.laws = {kind: EntryLaw(max_len, block, decay, resolve_every) for kind in ENTRY_KINDS}
        self.end_laws = {kind: EntryLaw(max_len, block, decay, resolve_every) for kind in ENTRY_KINDS}
        self.state_tokens = max(float(state_tokens), 0.0)
        self._kinds: dict[int, str] = {}  # node id -> kind of the entry that created it
        # a stint: the time a state-holding node keeps one shape (entry or split-made, leaf or inner); node id ->
        # shape, and the nodes whose states were resumed from during their current stint
        self._stint_shapes: dict[int, int] = {}
        self._resumed: set[int] = set()
        self._resumed_inside: set[int] = set()  # entries' leaves resumed from an in-edge state this stint
        self._planned_kind, self._leaf_pending = "branch", False  # the admitted entry's leaf not yet added

    def __deepcopy__(self, memo: dict) -> PricedAdmission:
        """A copy without the tree (`core.fork` links the copy to the forked tree through the eviction); within a
        deep copy of the whole core, the copy of its tree."""
        twin = copy.copy(self)
        for name, value in self.__dict__.items():
            if name in _ID_CONTAINERS:  # node ids to kinds and shapes: a copy of the container is a deep copy
                setattr(twin, name, value.copy())
            elif name != "tree":
                setattr(twin, name, copy.deepcopy(value, memo))
        twin.tree = memo.get(id(self.tree), self.tree)
        return twin

    def state(self, node_ids: set[int]) -> dict:
        """What this admission has learned, JSON-able (see `restore`): its laws and, of the nodes `node_ids` (the
        saved tree's), the entries' kinds and the stints under way."""
        def pairs(mapping: dict[int, object]) -> list:
            return [[node_id, value] for node_id, value in mapping.items() if node_id in node_ids]

        return {"law": self.law.state(), "laws": {kind: law.state() for kind, law in self.laws.items()},
                "end_laws": {kind: law.state() for kind, law in self.end_laws.items()},
                "kinds": pairs(self._kinds), "stint_shapes": pairs(self._stint_shapes),
                "resumed": sorted(self._resumed & node_ids), "resumed_inside": sorted(self._resumed_inside & node_ids)}

    def restore(self, state: dict, node_ids: set[int]) -> None:
        """Put back a `state()` saved over a tree whose node ids are `node_ids` (rebuilt with the same ids), so that
        this admission goes on as the saved one would; ValueError (KeyError, TypeError) if `state` is not one."""
        if set(state["laws"]) != set(ENTRY_KINDS) or set(state["end_laws"]) != set(ENTRY_KINDS):
            raise ValueError(f"laws of kinds {sorted(state['laws'])}, {sorted(state['end_laws'])}")
        kinds, shapes = dict(map(tuple, state["kinds"])), dict(map(tuple, state["stint_shapes"]))
        resumed, inside = set(state["resumed"]), set(state["resumed_inside"])
        if not set(kinds.values()) <= set(ENTRY_KINDS) or not set(shapes.values()) <= {0, 1, 2, 3}:
            raise ValueError("entry kinds or stint shapes")
        if not (kinds.keys() | shapes.keys() | resumed | inside) <= node_ids:
            raise ValueError("kinds or stints of nodes not in the tree")
        law, laws, end_laws = (copy.deepcopy(x) for x in (self.law, self.laws, self.end_laws))
        law.restore(state["law"])  # (into copies: a bad law leaves this admission as it was)
        for kind in ENTRY_KINDS:
            laws[kind].restore(state["laws"][kind])
            end_laws[kind].restore(state["end_laws"][kind])
        self.law, self.laws, self.end_laws = law, laws, end_laws
        self._kinds, self._stint_shapes, self._resumed, self._resumed_inside = kinds, shapes, resumed, inside
        self._leaf_pending = False

    def seed(self, other: MarconiAdmission) -> None:
        self.law, self.laws, self.end_laws = (copy.deepcopy(x) for x in (other.law, other.laws, other.end_laws))

    @property
    def fill(self) -> float:
        """Share of the byte budget in use (1 when unknown): free bytes displace nothing yet."""
        if self.tree is None or self.capacity_bytes <= 0:
            return 1.0
        return min(self.tree.used_bytes / self.capacity_bytes, 1.0)

    def kind_of(self, node: Node) -> str:
        """The kind of the entry `node`'s edge came from (a split's upper part: that of the part below it)."""
        for _ in range(8):
            kind = self._kinds.get(node.id)
            if kind is not None or not node.children:
                return kind or "branch"
            node = next(iter(node.children.values()))
        return "branch"

    def forget(self, node: Node) -> None:
        """`node` left the tree (called by the paired eviction policy)."""
        self._stint_shapes.pop(node.id, None)
        self._resumed.discard(node.id)
        self._resumed_inside.discard(node.id)
        self._kinds.pop(node.id, None)

    def shape_of(self, node: Node) -> int:
        """-1 without states, else 2 * (made by a split, not by an entry) + (inner); 0: an entry's leaf."""
        return 2 * (node.id not in self._kinds) + bool(node.children) if node.ckpt_pos else -1

    def track(self, node: Node) -> bool:
        """`node` changed (called by the paired eviction policy): a new shape ends its stint and starts one. True
        if it did. A stint counts when it starts, and once more when a request first resumes from it."""
        node_id, kinds, shapes = node.id, self._kinds, self._stint_shapes
        if (self._leaf_pending and not node.children and node_id not in kinds and node_id not in shapes
                and not node.is_root):  # (a namespace's root left childless by an eviction: not an entry's leaf)
            kinds[node_id], self._leaf_pending = self._planned_kind, False  # the planned entry's new leaf
        shape = 2 * (node_id not in kinds) + bool(node.children) if node.ckpt_pos else -1  # shape_of (hot path)
        if shapes.get(node_id, -1) == shape:
            return False
        self._resumed.discard(node_id)
        self._resumed_inside.discard(node_id)
        shapes.pop(node_id, None)
        if shape >= 0:
            shapes[node_id] = shape
            self._count_stint(shape, resumed=False)
        return True

    def _count_stint(self, shape: int, resumed: bool) -> None:
        law = self.law
        if resumed:
            law.stints_resumed += law._scale
            if shape == 0:
                law.leaf_stints_resumed += law._scale
        else:
            law.stints += law._scale
            if shape == 0:
                law.leaf_stints += law._scale

    def observe(self, walk: Walk, reused_length: int) -> None:
        law, shared = self.law, walk.shared_length
        law.tick()
        for kind_law in (*self.laws.values(), *self.end_laws.values()):
            kind_law.tick()
        scale = law._scale  # law.add inlined (hot path): the same float expressions
        law.reused += reused_length * scale
        law.computed += (walk.walked - reused_length) * scale
        if shared == 0:
            return
        for node in reversed(walk.path[1:]):  # Marconi's states sit at edge ends: one inside an edge is placed
            if node.start < reused_length <= node.end:
                shape = self._stint_shapes.get(node.id, -1)
                if shape == 0 and reused_length < node.ckpt_pos[-1]:
                    # an entry's leaf resumed short of its end: the prefix above the state was reused, and the
                    # request's split makes it a stored node; the leaf's end (what leaf_weight prices) was not
                    if node.id not in self._resumed_inside:
                        self._resumed_inside.add(node.id)
                        self._count_stint(2, resumed=True)
                elif shape >= 0 and node.id not in self._resumed:
                    self._resumed.add(node.id)
                    self._count_stint(shape, resumed=True)
                if reused_length < node.end:
                    law.add("realized", reused_length - node.start)
                break
        if shared == walk.walked:
            law.add("repeats")
        node = walk.path[-1]
        if shared < node.end:  # a branch point (an edge's end) already holds Marconi's state
            kind = self.kind_of(node)
            self.laws[kind].add_interior(shared - node.start)
            self.end_laws[kind].add_interior(node.end - shared)

    def before_admit(self, walk: Walk) -> None:
        self._planned_kind, self._leaf_pending = _entry_kind(walk), True

    def plan(self, walk: Walk, length: int, reused: int, input_length: int = 0) -> list[int]:
        marconi = super().plan(walk, length, reused)  # (planning changes nothing it depends on: kept for the end)
        positions = set(marconi)
        start = walk.shared_length
        kind = _entry_kind(walk)
        law = self.laws[kind]
        if length > start:
            for counted in (self.law, law, self.end_laws[kind]):
                counted.entries += counted._scale  # law.add("entries") inlined (hot path): the same floats
        # predicted savings are discounted by how well past predictions came true
        price = self.state_tokens * self.law.pressure * self.fill
        price /= self.law.calibration(self.state_tokens)
        predicted = 0.0
        span = length - start
        table, blocks = (law.table(), span // law.block) if law.bound(span) > price else (None, 0)
        if table is not None and blocks > 1:
            # the m-th state is kept while its saving beats the price (the longest such prefix of the curve; the
            # table solves its layers as far as this reads)
            gains, cost = [], table.cost(0, blocks)
            while len(gains) < table.layers:
                next_cost = table.cost(len(gains) + 1, blocks)
                gain = -(next_cost - cost)
                if gain <= price:
                    break
                gains.append(gain)
                cost = next_cost
            if gains:  # (no state is worth its price, the usual case: nothing to backtrack)
                positions.update(start + p * law.block for p in table.positions(len(gains), blocks)
                                 if reused < start + p * law.block < length)
                predicted += sum(gains)
        elif price <= 0 and law.interior <= 0 and span > 1:
            # states cost nothing yet (an empty cache, or nothing stored has been reused) and the law has seen no
            # overlap: a uniform prior, `prior_states` evenly spaced states (the first divergences, before any
            # was seen, are caught; thinning drops them first once the law says they serve nothing)
            positions.update(start + p for p in balanced_positions(span - 1, self.prior_states) if reused < start + p)
        end_law = self.end_laws[kind]
        distance, saving = end_law.best_from_end(span) if end_law.bound(span) > price else (0, 0.0)
        if saving > price and reused < length - distance:
            positions.add(length - distance)
            predicted += saving
        end = input_length
        repeat_saving = self.law.repeat_rate * (end - reused)
        if reused < end < length and repeat_saving > price:
            positions.add(end)
            predicted += repeat_saving
        self.law.predicted += predicted * self.law._scale  # law.add("predicted", ...) inlined (hot path)
        if not self._fits_budget(span, len(positions)) and self._fits_budget(span, len(marconi)):
            # dp's states would make an entry that fits the whole budget outgrow it, and a strict budget then cuts
            # the entry at one of them (a long document losing its end): only Marconi's are kept. (An entry too
            # big either way keeps them: they are where it can be cut.)
            positions = set(marconi)
        return sorted(positions)

    def _fits_budget(self, tokens: int, states: int) -> bool:
        """Whether `tokens` new KV tokens and `states` states fit in the whole byte budget (True when unknown, or
        when entries over the budget are kept whole)."""
        if self.tree is None or self.capacity_bytes <= 0 or self.token_bytes <= 0:
            return True
        return (tokens + states * self.state_tokens) * self.token_bytes <= self.capacity_bytes

    def overlap_masses(self, node: Node, count: int) -> list[float]:
        """Expected overlaps per entry that would resume from each of the first `count` checkpoints of `node`: those
        leaving the edge between it and the next checkpoint (depths measured from the edge's start, as the law is)."""
        positions, start, end = node.ckpt_pos, node.start, node.start + len(node.tokens)
        law = self.laws[self.kind_of(node)]
        block, mass = law.block, law.interior_mass
        return [mass((positions[i] - start) // block,
                     ((positions[i + 1] if i + 1 < len(positions) else end + 1) - start) // block)
                for i in range(count)]

    def after_admit(self, tree: RadixTree, deepest: Node, length: int, locked: frozenset[int] = frozenset(),
                    restore: bool = False) -> None:
        self._leaf_pending = False
        # no new leaf: an existing node (made by a split) ends the entry (a root ends none: an empty entry; roots
        # leave the tree without on_remove, so a kind kept for one would never be forgotten)
        if deepest.id not in self._kinds and not deepest.is_root:
            self._kinds[deepest.id] = self._planned_kind
            tree.on_change(deepest)


def _entry_kind(walk: Walk) -> str:
    """"extend": the entry goes on from the end of a stored leaf (a conversation's next turn); else "branch"."""
    start, last = walk.shared_length, walk.path[-1]
    return "extend" if start and start == last.end and not last.children else "branch"
