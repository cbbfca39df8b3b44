"""dp's overlap law: where requests leave entries, as decayed block-binned depth counts, and the events that price
a placed state (see priced.py, which prices with it)."""

from __future__ import annotations

import copy

import numpy as np

from prefixlab.cache.placement import PlacementTable, _check_count, check_decay
from prefixlab.errors import is_finite_number, is_int

MAX_PLACED = 16  # DP states per entry; the DP is O(blocks * MAX_PLACED)
_TABLES: dict[bytes, PlacementTable] = {}  # solved histograms, by their bytes (alpha's window replays share many)


def _solved(hist: np.ndarray) -> PlacementTable:
    """PlacementTable(hist, MAX_PLACED), reused when the same histogram (bit for bit) was solved before: the
    table is a pure function of it (its layers are solved when first read, the same whoever reads them)."""
    key = hist.tobytes()
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 64:
            _TABLES.clear()
        table = _TABLES[key] = PlacementTable(hist, MAX_PLACED)
    return table
# Where a new entry hangs in the tree: continuing a leaf from its end (a next turn), or anywhere else (the root,
# inside an edge, a branch point). Each kind has its own law: next turns are rarely left midway, prompts are.
ENTRY_KINDS = ("extend", "branch")


TOTALS = ("requests", "entries", "repeats", "reused", "computed", "predicted", "realized", "interior",
          "stints", "stints_resumed", "leaf_stints", "leaf_stints_resumed")


class EntryLaw:
    """Decayed counts of interior overlap depths (block-binned) and of the events that price them."""

    def __init__(self, max_len: int, block: int, decay: float, resolve_every: int) -> None:
        max_len, block = _check_count("max_len", max_len, 0), _check_count("block", block, 1)
        self.block, self.decay = block, check_decay(decay)
        self.resolve_every = _check_count("resolve_every", resolve_every, 1)
        self.bins = max_len // block + 1
        self._interior = np.zeros(self.bins)  # stored scaled by `_scale` (decay^-requests): O(1) per request
        self._scale = 1.0
        # decayed (scaled) totals: requests, admitted entries, prompt repeats, reused and computed tokens, and the
        # tokens placed states were predicted to save and did save
        self.requests = self.entries = self.repeats = self.reused = self.computed = 0.0
        self.predicted = self.realized = 0.0
        # stints of stored nodes (see PricedAdmission.track), and those whose states were resumed from (leaf_: the
        # stints of entries' leaves)
        self.stints = self.stints_resumed = self.leaf_stints = self.leaf_stints_resumed = 0.0
        self._leaf_weight = (None, 1.0)  # (epoch, weight): fixed within an epoch, as the DP's solutions are
        self.interior = 0.0  # the histogram's sum, kept as a scalar: the plan's cheap bound
        self._sums: dict[tuple[int, int], float] = {}  # interior_mass's slice sums of the histogram as it is
        self.seen = 0
        self._table: PlacementTable | None | bool = False  # False: not solved yet
        self._table_hist: np.ndarray | None = None  # what the table was solved for
        self._cumulative: tuple[int, np.ndarray] | None = None
        self._distances: np.ndarray | None = None  # best_from_end's candidate distances (never modified)
        self._epoch = 0

    def __deepcopy__(self, memo: dict) -> EntryLaw:
        """The histogram is the one array changed in place; the solved tables and cached arrays are shared (they
        are never modified), the rest are numbers."""
        twin = memo[id(self)] = copy.copy(self)
        twin._interior, twin._sums = self._interior.copy(), dict(self._sums)
        return twin

    def tick(self) -> None:
        """One request: age every count by `decay` (renormalising before the scale overflows)."""
        self._scale /= self.decay
        if self._scale > 1e100:
            self._interior /= self._scale
            self._sums = {}
            for name in TOTALS:
                setattr(self, name, getattr(self, name) / self._scale)
            self._scale = 1.0
        self.requests += self._scale
        self.seen += 1

    def add_interior(self, depth: int) -> None:
        self._interior[min(depth // self.block, self.bins - 1)] += self._scale
        self._sums = {}
        self.interior += self._scale

    def add(self, field: str, amount: float = 1.0) -> None:
        setattr(self, field, getattr(self, field) + amount * self._scale)

    @property
    def pressure(self) -> float:
        """Reused tokens per computed token: what a KV token at the margin is assumed to buy (in [0, 1])."""
        return self.reused / (self.reused + self.computed) if self.reused + self.computed > 0 else 0.0

    def calibration(self, prior_tokens: float) -> float:
        """Tokens placed states saved per token they were predicted to save (1 with nothing seen: a prior of
        `prior_tokens` on both sides). A law that does not come true stops paying for states."""
        prior = prior_tokens * self._scale
        seen = self.predicted + prior
        return (self.realized + prior) / seen if seen > 0 else 1.0  # (a zero-token state's prior: nothing to scale)

    def bound(self, span: int) -> float:
        """An upper bound on what any states placed in an entry of `span` tokens save per entry (every interior
        overlap resuming at its own depth): states are not worth solving for when it is under the price."""
        return self.interior / self.entries * span if self.entries > 0 else 0.0

    def odds(self, resumed: float, stints: float) -> float:
        """A decayed share of stints (with a prior of one half a stint on each side)."""
        return (resumed + 0.5 * self._scale) / (stints + self._scale)

    def leaf_weight(self) -> float:
        """How likely an entry's leaf is resumed from its end before it changes shape or leaves the tree,
        relative to any stored node (at most 1): Marconi's FLOP efficiency of a leaf counts FLOPs a hit would
        save, and where an entry's end is rarely reused (few-shot prompts, prompt + question entries) a long leaf
        is worth less than its FLOPs say."""
        if self._leaf_weight[0] != self.epoch:
            leaf = self.odds(self.leaf_stints_resumed, self.leaf_stints)
            self._leaf_weight = (self.epoch, min(1.0, leaf / self.odds(self.stints_resumed, self.stints)))
        return self._leaf_weight[1]

    @property
    def repeat_rate(self) -> float:
        """Prompt repeats per admitted entry."""
        return self.repeats / self.entries if self.entries > 0 else 0.0

    def interior_mass(self, first_bin: int, last_bin: int) -> float:
        """Interior overlaps per admitted entry at depths in bins [first_bin, last_bin)."""
        if self.entries <= 0:
            return 0.0
        total = self._sums.get((first_bin, last_bin))
        if total is None:  # the same bins' sum again until the histogram changes: thinning values many states a request
            bins = self._interior[first_bin:max(first_bin, last_bin)]
            # np.add.reduce is what ndarray.sum calls (the same float), without its Python wrapper
            total = self._sums[first_bin, last_bin] = float(np.add.reduce(bins))
        return total / self.entries

    @property
    def epoch(self) -> int:
        """Solutions are kept within an epoch: `resolve_every` requests, and at first every doubling of the
        requests seen (a young law changes fast)."""
        return self.seen // self.resolve_every if self.seen >= self.resolve_every else -self.seen.bit_length()

    def best_from_end(self, length: int) -> tuple[int, float]:
        """For this law read as distances from an entry's end: (distance D, saving) of the one state at D that
        saves the most tokens per entry of `length` tokens: overlaps at distances <= D resume from it instead of
        the entry's start, saving `length - D` each."""
        epoch = self.epoch
        if self._cumulative is None or self._cumulative[0] != epoch:
            mass = np.cumsum(self._interior) / self.entries if self.entries > 0 else np.zeros(self.bins)
            self._cumulative = (epoch, mass)
        blocks = min(length // self.block, self.bins)
        if blocks < 1:
            return 0, 0.0
        if self._distances is None:
            self._distances = (np.arange(self.bins) + 1) * self.block
        distances = self._distances[:blocks]  # a state at D serves the distances of blocks < D/block
        savings = self._cumulative[1][:blocks] * (length - distances)
        best = int(savings.argmax())  # (the method: np.argmax adds a dispatch, a microsecond a plan)
        return int(distances[best]), float(savings[best])

    def table(self) -> PlacementTable | None:
        """The DP over the law (every entry length, every budget up to MAX_PLACED), re-solved every
        `resolve_every` requests; None while no interior overlap was seen."""
        epoch = self.epoch
        if epoch != self._epoch or self._table is False:
            self._epoch, self._table = epoch, None
            total = self._interior.sum()
            if self.entries > 0 and total > 0 and np.isfinite(total):
                # an overlap in block b resumes at best from a checkpoint at block b's start: the block DP, over
                # the depths seen so far (an entry reaching past them has nothing more to place)
                seen = int(np.flatnonzero(self._interior)[-1]) + 1
                self._table_hist = self._interior[:seen] / self.entries * self.block  # (kept: a saved law's table)
                self._table = _solved(self._table_hist)
        return self._table

    def state(self) -> dict:
        """What this law has learned, JSON-able and exact (floats round-trip through JSON): its counts, histogram
        and the solutions it keeps for the current epoch (the table, best_from_end's masses, the leaf weight),
        which `restore` puts back so that the law goes on as if it had never been saved."""
        cumulative = self._cumulative
        return {
            "scale": self._scale, "seen": self.seen, "epoch": self._epoch,
            "totals": [getattr(self, name) for name in TOTALS], "histogram": _sparse(self._interior),
            "table": self._table if self._table is None or self._table is False else _sparse(self._table_hist),
            "cumulative": None if cumulative is None else [cumulative[0], _sparse(cumulative[1])],
            "leaf_weight": list(self._leaf_weight),
        }

    def restore(self, state: dict) -> None:
        """Put back what `state` (a `state()` of a law of the same depth bins) recorded; ValueError (or KeyError,
        TypeError) if it is not one, changing nothing then."""
        scale, seen, epoch, totals = state["scale"], state["seen"], state["epoch"], state["totals"]
        if not (is_finite_number(scale) and scale >= 1.0 and is_int(seen) and seen >= 0 and is_int(epoch)):
            raise ValueError(f"law scale={scale!r}, seen={seen!r}, epoch={epoch!r}")
        if not (isinstance(totals, list) and len(totals) == len(TOTALS)
                and all(is_finite_number(t) and t >= 0 for t in totals)):
            raise ValueError(f"law totals {totals!r}")
        histogram, table = _dense(state["histogram"], self.bins, whole=True), state["table"]
        table_hist = table if table is None or table is False else _dense(table, self.bins)
        solved = table_hist if table_hist is None or table_hist is False else _solved(table_hist)
        cumulative = state["cumulative"]
        if cumulative is not None:
            if not (isinstance(cumulative, list) and len(cumulative) == 2 and is_int(cumulative[0])):
                raise ValueError(f"law cumulative {cumulative!r}")
            cumulative = (cumulative[0], _dense(cumulative[1], self.bins, whole=True))
        leaf_epoch, leaf_weight = state["leaf_weight"]
        if not ((leaf_epoch is None or is_int(leaf_epoch)) and is_finite_number(leaf_weight) and 0 < leaf_weight <= 1):
            raise ValueError(f"law leaf weight {state['leaf_weight']!r}")
        self._scale, self.seen, self._epoch, self._interior, self._sums = float(scale), seen, epoch, histogram, {}
        for name, total in zip(TOTALS, totals, strict=True):
            setattr(self, name, float(total))
        self._table, self._table_hist = solved, None if solved is None or solved is False else table_hist
        self._cumulative, self._leaf_weight = cumulative, (leaf_epoch, float(leaf_weight))


def _sparse(array: np.ndarray) -> list:
    """[length, nonzero indexes, their values]: a decayed histogram is mostly zeros."""
    where = np.flatnonzero(array)
    return [len(array), where.tolist(), array[where].tolist()]


def _dense(sparse: object, bins: int, whole: bool = False) -> np.ndarray:
    """The array `_sparse` wrote, at most `bins` long (`whole`: exactly); ValueError unless its values are finite
    and >= 0."""
    length, where, values = sparse
    if not (is_int(length) and 0 < length <= bins and (length == bins or not whole) and isinstance(where, list)
            and isinstance(values, list) and len(where) == len(values)
            and all(is_int(i) and 0 <= i < length for i in where)
            and all(is_finite_number(v) and v >= 0 for v in values)):
        raise ValueError(f"a law array of {bins} bins: {str(sparse)[:80]}")
    array = np.zeros(length)
    array[where] = values
    return array
