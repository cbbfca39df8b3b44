"""Where to put recurrent checkpoints inside one cache entry (sparse prefix caching, Theorem 2).

A future request overlaps the entry on exactly `i` tokens with probability `hist[i]` (i = 0 .. len(hist) - 1) and
resumes from the deepest checkpoint `c <= i` (position 0, the zero state, is free), recomputing `i - c` tokens.
Checkpoints go at positions 1 .. len(hist) - 1. With prefix sums `W[j] = sum_{i<j} hist[i]` and
`V[j] = sum_{i<j} i hist[i]`, a segment served by a checkpoint at k up to the next one at j costs
`C(k, j) = V[j] - V[k] - k (W[j] - W[k])`, and with `F_m(j)` the best cost of overlaps `< j` using m checkpoints

    F_m(j) = V[j] + min_k (b_k - k W[j]),   b_k = F_{m-1}(k) - V[k] + k W[k],   F_0(j) = V[j].

Letting k range over all positions (not only k < j) is harmless: k >= j costs at least F_{m-1}(j), which k = j
attains ("use one checkpoint fewer"). Each layer is a lower envelope of lines with slopes -k queried at the
non-decreasing points W[j]: the monotone convex hull trick, O(N) per layer, O(N M) in all.
`_layer_reference` is that algorithm in plain Python; `_layer` computes the same envelope with two C calls: the
lower hull of the points (k, b_k) is their greatest convex minorant, whose slopes are the isotonic regression of
diff(b) (scipy's PAVA, O(N)), and the best line for x is the hull vertex where those slopes reach x
(searchsorted, N binary searches).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
from scipy.optimize import isotonic_regression

from prefixlab.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class PlacementResult:
    """Optimal checkpoints for a budget: `cost_curve[m]` is the optimal expected recompute with m checkpoints."""

    positions: list[int]
    expected_cost: float
    cost_curve: np.ndarray


def _check_count(name: str, value, minimum: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidInputError(f"{name}={value} must be >= {minimum}{why}")
    return int(value)


def check_decay(decay) -> float:
    """A decayed histogram's `decay`: the weight a count keeps per observation, a number in (0, 1] (0 divides by
    zero, NaN makes every count NaN, above 1 counts grow)."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0.0 < decay <= 1.0:
        raise InvalidInputError(f"decay={decay!r} must be a number in (0, 1]")
    return float(decay)


NO_CHECKPOINTS = " (0 checkpoints is no placement: position 0, the zero state, is always free)"


def _probabilities(hist) -> np.ndarray:
    """`hist` as float64 probabilities; raises InvalidInputError naming `hist` on bad input."""
    try:
        weights = np.asarray(hist, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"hist must be a 1-D sequence of numbers: {exc}") from None
    if weights.ndim != 1 or weights.size == 0:
        raise InvalidInputError(f"hist must be a non-empty 1-D histogram of overlap depths, got shape {weights.shape}")
    if not np.isfinite(weights).all():
        raise InvalidInputError("hist has NaN or infinite entries; pass finite counts or probabilities")
    if (weights < 0).any():
        raise InvalidInputError(f"hist has negative entries (min {weights.min()}); counts must be >= 0")
    peak = weights.max()
    if peak <= 0:
        raise InvalidInputError("hist is all zeros; observe at least one overlap (or pass a uniform prior)")
    weights = weights / peak  # so that the sum cannot overflow
    return weights / weights.sum()


def _prefix_sums(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W[j] = P(overlap < j), V[j] = E[overlap; overlap < j], for j = 0 .. len(probs)."""
    depth = np.arange(probs.size, dtype=np.float64)
    zero = np.zeros(1)
    return np.concatenate([zero, np.cumsum(probs)]), np.concatenate([zero, np.cumsum(depth * probs)])


def _layer(b: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each query x[j] (non-decreasing): min_k b[k] - k x[j] and its leftmost argmin, via the convex minorant."""
    hull_slopes = isotonic_regression(b[1:] - b[:-1]).x  # np.diff's subtraction, without its per-call overhead
    best_k = hull_slopes.searchsorted(x, side="left")  # first hull vertex whose right slope reaches x
    return b[best_k] - best_k * x, best_k


def _layer_reference(b: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_layer` as the textbook monotone convex hull trick: add lines by decreasing slope, sweep queries upward."""
    hull: list[tuple[int, float]] = []  # (k, b_k) of lines on the lower envelope, slopes -k decreasing
    for k, intercept in enumerate(b.tolist()):
        while len(hull) >= 2:
            (k1, b1), (k2, b2) = hull[-2], hull[-1]
            # line k2 is never strictly lowest once line k meets line k1 no later than k2 does
            if (intercept - b1) * (k2 - k1) <= (b2 - b1) * (k - k1):
                hull.pop()
            else:
                break
        hull.append((k, intercept))
    values, best_k, at = np.empty(x.size), np.empty(x.size, dtype=np.int64), 0
    for j, query in enumerate(x.tolist()):
        while at + 1 < len(hull) and hull[at + 1][1] - hull[at + 1][0] * query < hull[at][1] - hull[at][0] * query:
            at += 1
        best_k[j], values[j] = hull[at][0], hull[at][1] - hull[at][0] * query
    return values, best_k


def solve_placement(hist, budget: int) -> PlacementResult:
    """Optimal checkpoint positions (at most `budget`) for the overlap histogram `hist` (counts or probabilities).

    Positions are in [1, len(hist) - 1]; fewer than `budget` come back when more would not lower the cost.
    """
    return _solve(hist, budget, _layer)


def _solve(hist, budget: int, layer) -> PlacementResult:
    """The DP of the module docstring with one envelope step `layer` (`_layer` or `_layer_reference`)."""
    probs, costs, choices = _tables(hist, budget, layer)
    n = probs.size
    curve = [float(F[n]) for F in costs]
    curve += [curve[-1]] * (budget + 1 - len(curve))
    positions = _backtrack(choices, n)
    return PlacementResult(positions, expected_recompute(probs, positions), np.maximum(np.array(curve), 0.0))


def _tables(hist, budget: int, layer) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(probabilities, F_m(j) for every layer m and every j, each layer's argmin choices)."""
    dp = _LayeredDP(hist, budget, layer)
    dp.solve(dp.layers)
    return dp.probs, dp.costs, dp.choices


class _LayeredDP:
    """The DP one layer at a time: `costs[m]` is F_m (every j), `choices[m - 1]` layer m's argmin choices."""

    def __init__(self, hist, budget: int, layer) -> None:
        budget = _check_count("budget", budget, 1, NO_CHECKPOINTS)
        self.probs = _probabilities(hist)
        self.n, self._layer = self.probs.size, layer
        self._W, self._V = _prefix_sums(self.probs)
        # the terms every layer shares: V[:n] and k W[:n]
        self._V_n, self._kW = self._V[:self.n], np.arange(self.n, dtype=np.float64) * self._W[:self.n]
        # a checkpoint only pays where some overlap has weight, so more layers than that can only repeat the optimum
        self.layers = min(budget, int(np.count_nonzero(self.probs[1:])))
        self.costs: list[np.ndarray] = [self._V]
        self.choices: list[np.ndarray] = []

    def solve(self, m: int) -> None:
        """Solve the layers up to m (at most `layers`)."""
        while len(self.choices) < min(m, self.layers):
            F, best_k = self._layer(self.costs[-1][:self.n] - self._V_n + self._kW, self._W)
            self.costs.append(F + self._V)
            self.choices.append(best_k)


class PlacementTable:
    """The DP for every prefix of `hist` and every budget up to `budget`: an entry whose overlaps beyond depth j
    are served by a state at j (its end) costs `cost(m, j)` with m more states, placed at `positions(m, j)`. Costs
    are in the units of `hist` (counts x depth), not normalised. A layer is solved when first read, so a caller
    that stops at the first state not worth its price solves only the layers it reads (the same arrays).
    Thread-safe: tables are shared (cache/law.py), and the alpha tuner's background replays read them beside the
    live cache; a layer is solved under the table's lock (two threads solving one would append it twice)."""

    def __init__(self, hist, budget: int) -> None:
        self._dp = _LayeredDP(hist, budget, _layer)
        with np.errstate(over="ignore"):
            self._total = float(np.asarray(hist, dtype=np.float64).sum())
        if not math.isfinite(self._total):  # (the costs, in hist's units, would be NaN)
            raise InvalidInputError("hist's total overflows a float; scale its counts down")
        self._costs: list[np.ndarray] = []  # the solved layers' costs, clipped at 0 and scaled to hist's units
        self._lock = threading.Lock()
        self.n = self._dp.n
        self.layers = self._dp.layers  # budgets beyond this cannot lower any cost

    def _solve(self, m: int) -> None:
        with self._lock:
            self._dp.solve(m)
            for F in self._dp.costs[len(self._costs):]:
                self._costs.append(np.maximum(F, 0.0) * self._total)

    def cost(self, m: int, j: int) -> float:
        """cost(m, j), m <= layers."""
        if m >= len(self._costs):
            if m > self.layers:
                raise InvalidInputError(f"m={m} is beyond the table's {self.layers} layers (more states cannot lower "
                                        "any cost: read cost(layers, j))")
            self._solve(m)
        return float(self._costs[m][min(j, self.n)])

    def curve(self, j: int) -> np.ndarray:
        """cost(m, j) for m = 0 .. layers."""
        self._solve(self.layers)
        return np.array([F[min(j, self.n)] for F in self._costs])

    def positions(self, m: int, j: int) -> list[int]:
        if min(m, self.layers) > len(self._dp.choices):
            self._solve(m)
        return _backtrack(self._dp.choices[:m], min(j, self.n))


def _backtrack(choices: list[np.ndarray], n: int) -> list[int]:
    """Checkpoint positions behind F_M(n): layer m's choice k at j is the last checkpoint before j (k = 0: none
    left; k >= j: this layer spends no checkpoint)."""
    positions, j = [], n
    for best_k in reversed(choices):
        k = int(best_k[j])
        if k == 0:
            break
        if k < j:
            positions.append(k)
            j = k
    return sorted(positions)


def optimal_checkpoints(hist, budget: int) -> tuple[list[int], float]:
    """(positions, expected recomputed tokens) of the optimal placement of at most `budget` checkpoints."""
    result = solve_placement(hist, budget)
    return result.positions, result.expected_cost


def expected_recompute(hist, positions) -> float:
    """Expected recomputed tokens when requests overlap per `hist` and resume from the deepest checkpoint."""
    probs = _probabilities(hist)
    if not all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in positions):
        raise InvalidInputError(f"positions must be int token positions, got {positions!r}")
    marks = np.asarray(sorted(positions), dtype=np.int64)
    if marks.size and (marks[0] < 1 or marks[-1] >= probs.size):
        raise InvalidInputError(f"positions must lie in [1, {probs.size - 1}] (len(hist) - 1), got {positions}")
    depth = np.arange(probs.size)
    resume = np.concatenate([[0], marks])[np.searchsorted(marks, depth, side="right")]
    return float(np.dot(probs, depth - resume))


def balanced_positions(length: int, budget: int) -> list[int]:
    """`budget` checkpoints splitting overlaps 0..length into segments whose lengths differ by at most one:
    optimal when every overlap depth is equally likely (Theorem 1)."""
    length, budget = _check_count("length", length, 1), _check_count("budget", budget, 1, NO_CHECKPOINTS)
    segments = min(budget, length) + 1
    return [(length + 1) * s // segments for s in range(1, segments)]


def block_positions(length: int, block: int) -> list[int]:
    """A checkpoint every `block` tokens (vLLM-style block-aligned states): block, 2 block, ... <= length."""
    length, block = _check_count("length", length, 1), _check_count("block", block, 1)
    return list(range(block, length + 1, block))


def log_positions(length: int, budget: int) -> list[int]:
    """Checkpoints denser near the end: distances from `length` grow geometrically (0, ~length^(1/budget), ...).

    In multi-turn traffic most hits continue the whole previous context (overlap close to the entry's end), so
    short gaps there waste few tokens on the common hits, while rarer short overlaps tolerate long gaps.
    """
    length, budget = _check_count("length", length, 1), _check_count("budget", budget, 1, NO_CHECKPOINTS)
    distances = {round(length ** (s / budget)) - 1 for s in range(budget)}
    return sorted(length - d for d in distances if d < length)


class OverlapHistogram:
    """Exponentially decayed histogram of observed overlap depths, solving placements at block granularity.

    Each `observe` scales past counts by `decay`. `positions(length, budget)` solves the DP on block sums: with
    checkpoints restricted to multiples of `block` (floor: a checkpoint can only serve overlaps at or beyond
    it), an overlap i costs `i mod block` (fixed) plus `block` times the block-level cost, so the block DP is
    exactly optimal among block-aligned placements. Overlaps >= length count as length (they resume from the
    entry's end at best). Solutions are cached and re-solved every `resolve_every` observations; with nothing
    observed yet the law is uniform, so placements are balanced.
    """

    def __init__(self, max_len: int, decay: float = 0.99, block: int = 64, resolve_every: int = 10) -> None:
        self.max_len = _check_count("max_len", max_len, 1)
        self.block = _check_count("block", block, 1)
        self.resolve_every = _check_count("resolve_every", resolve_every, 1)
        self.decay = check_decay(decay)
        self.observations = 0
        # counts are stored scaled by `_scale` = decay^-observations so an observation is O(1), not O(max_len)
        self._counts = np.zeros(self.max_len + 1)
        self._scale = 1.0
        self._cache: dict[tuple[int, int], list[int]] = {}
        self._cache_epoch = 0

    def observe(self, overlap_depth: int) -> None:
        """Record one request's overlap depth in tokens (depths beyond max_len count as max_len)."""
        depth = _check_count("overlap_depth", overlap_depth, 0)
        self._scale /= self.decay
        if self._scale > 1e200:  # renormalise before the scaled counts overflow
            self._counts /= self._scale
            self._scale = 1.0
        self._counts[min(depth, self.max_len)] += self._scale
        self.observations += 1

    @property
    def counts(self) -> np.ndarray:
        """Decayed count per overlap depth 0..max_len (a copy)."""
        return self._counts / self._scale

    def positions(self, length: int, budget: int) -> list[int]:
        """Block-aligned DP checkpoint positions in [block, length] for an entry of `length` tokens."""
        length, budget = _check_count("length", length, 1), _check_count("budget", budget, 1, NO_CHECKPOINTS)
        epoch = self.observations // self.resolve_every
        if epoch != self._cache_epoch:
            self._cache, self._cache_epoch = {}, epoch
        key = (min(length, self.max_len), budget)
        if key not in self._cache:
            self._cache[key] = self._solve(*key)
        return self._cache[key]

    def _solve(self, length: int, budget: int) -> list[int]:
        n_blocks = length // self.block
        if n_blocks == 0:
            return []
        folded = self._counts[: length + 1].copy()
        folded[length] += self._counts[length + 1 :].sum()
        per_block = np.add.reduceat(folded, np.arange(0, length + 1, self.block))  # n_blocks + 1 sums
        if per_block.sum() <= 0:
            per_block[:] = 1.0
        return [p * self.block for p in solve_placement(per_block, budget).positions]
