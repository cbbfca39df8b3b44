"""Checkpoint placement: DP vs brute force and the CHT reference, Theorem 1 closed form, heuristics, histogram."""

from itertools import combinations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixlab.cache import placement
from prefixlab.cache.placement import (
    OverlapHistogram,
    balanced_positions,
    block_positions,
    expected_recompute,
    log_positions,
    optimal_checkpoints,
    solve_placement,
)
from prefixlab.errors import InvalidInputError

small_hists = st.lists(st.integers(0, 20), min_size=1, max_size=10).filter(any)


def brute_force_curve(hist, budget):
    """Best expected recompute over every subset of at most m positions, m = 0..budget."""
    candidates = range(1, len(hist))
    best = []
    for m in range(budget + 1):
        subsets = (s for size in range(min(m, len(hist) - 1) + 1) for s in combinations(candidates, size))
        best.append(min(expected_recompute(hist, s) for s in subsets))
    return best


@settings(max_examples=80, deadline=None)
@given(small_hists, st.integers(1, 4))
@example([0, 0, 0, 17, 19, 3, 17, 19, 3, 8], 1)  # the DP's sum and a direct recompute 3 ulps apart (abs=1e-15 failed)
def test_dp_matches_brute_force(hist, budget):
    result = solve_placement(hist, budget)
    np.testing.assert_allclose(result.cost_curve, brute_force_curve(hist, budget), atol=1e-12)
    assert result.expected_cost == pytest.approx(result.cost_curve[budget], abs=1e-12)
    # the same sum in another order: equal to rounding (a few ulps), not bit for bit
    assert result.expected_cost == pytest.approx(expected_recompute(hist, result.positions), rel=1e-12, abs=1e-12)
    assert result.positions == sorted(set(result.positions)) and len(result.positions) <= budget
    assert all(1 <= p < len(hist) for p in result.positions)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=2, max_size=400).filter(lambda h: sum(h) > 0), st.integers(1, 12))
def test_fast_envelope_matches_textbook_convex_hull_trick(hist, budget):
    fast = placement._solve(hist, budget, placement._layer)
    reference = placement._solve(hist, budget, placement._layer_reference)
    np.testing.assert_allclose(fast.cost_curve, reference.cost_curve, rtol=1e-9, atol=1e-9)
    assert fast.expected_cost == pytest.approx(reference.expected_cost, rel=1e-9, abs=1e-9)


def uniform_cost(length: int, checkpoints: int) -> float:
    """Theorem 1: overlaps uniform on 0..length and M checkpoints split the length + 1 depths into M + 1 segments.
    A segment of L depths recomputes 0 + 1 + ... + (L - 1) = L (L - 1) / 2 tokens; the sum is least when the
    lengths differ by at most one: r = (length + 1) mod (M + 1) segments of q + 1 depths, the rest of q."""
    q, r = divmod(length + 1, checkpoints + 1)
    return ((checkpoints + 1 - r) * q * (q - 1) / 2 + r * (q + 1) * q / 2) / (length + 1)


@pytest.mark.parametrize(("length", "budget"), [(1, 1), (10, 3), (100, 7), (1000, 32), (4096, 32), (63, 64)])
def test_uniform_law_balanced_is_optimal_with_closed_form_cost(length, budget):
    uniform = np.ones(length + 1)
    result = solve_placement(uniform, budget)
    closed_form = uniform_cost(length, min(budget, length))
    assert result.expected_cost == pytest.approx(closed_form, rel=1e-9, abs=1e-12)
    assert expected_recompute(uniform, balanced_positions(length, budget)) == pytest.approx(closed_form, rel=1e-12)
    for m in range(budget + 1):
        assert result.cost_curve[m] == pytest.approx(uniform_cost(length, min(m, length)), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1.0), min_size=2, max_size=200).filter(lambda h: sum(h) > 0), st.integers(1, 40))
def test_cost_curve_is_non_increasing_from_the_mean_overlap(hist, budget):
    curve = solve_placement(hist, budget).cost_curve
    assert curve.shape == (budget + 1,)
    assert np.all(np.diff(curve) <= 1e-12)
    probs = np.asarray(hist) / sum(hist)
    assert curve[0] == pytest.approx(float(np.dot(probs, np.arange(len(hist)))), rel=1e-9)


def test_enough_budget_recomputes_nothing():
    hist = np.random.default_rng(0).random(50)
    positions, cost = optimal_checkpoints(hist, 49)
    assert cost == 0.0 and positions == list(range(1, 50))
    assert optimal_checkpoints(hist, 500) == (positions, 0.0)


def test_only_weighted_depths_get_checkpoints():
    hist = np.zeros(100)
    hist[[30, 70]] = [1, 3]
    assert optimal_checkpoints(hist, 5) == ([30, 70], 0.0)
    assert optimal_checkpoints(hist, 1) == ([70], pytest.approx(30 / 4))


def test_counts_and_probabilities_agree():
    counts = [0, 3, 0, 5, 2, 9, 1]
    expected_positions, expected_cost = optimal_checkpoints(counts, 2)
    for scale in (1 / 20, 1e300, 1e-300):
        positions, cost = optimal_checkpoints([c * scale for c in counts], 2)
        assert positions == expected_positions and cost == pytest.approx(expected_cost, rel=1e-12)


@pytest.mark.parametrize(
    ("hist", "budget", "argument"),
    [([], 1, "hist"), ([[1, 2]], 1, "hist"), ([1, -1], 1, "hist"), ([1, float("nan")], 1, "hist"),
     ([1, float("inf")], 1, "hist"), ([0, 0, 0], 1, "hist"), (["a", 1], 1, "hist"), ([1, 2], 0, "budget"),
     ([1, 2], -3, "budget"), ([1, 2], 1.5, "budget"), ([1, 2], True, "budget"), ([1, 2], "2", "budget")],
)
def test_bad_input_raises_naming_the_argument(hist, budget, argument):
    with pytest.raises(InvalidInputError, match=argument):
        solve_placement(hist, budget)


def test_zero_budget_message_says_why():
    with pytest.raises(InvalidInputError, match=r"budget=0 must be >= 1 \(0 checkpoints is no placement"):
        optimal_checkpoints([1, 2, 3], 0)


def test_expected_recompute_refuses_positions_outside_the_histogram():
    with pytest.raises(InvalidInputError, match="positions"):
        expected_recompute([1, 1, 1], [3])
    with pytest.raises(InvalidInputError, match="positions"):
        expected_recompute([1, 1, 1], [0])
    with pytest.raises(InvalidInputError, match="positions"):
        expected_recompute([1, 1, 1], [1.5])


def test_balanced_positions_spacing():
    assert balanced_positions(10, 3) == [2, 5, 8]
    gaps = np.diff([0, *balanced_positions(4096, 32), 4097])
    assert gaps.max() - gaps.min() <= 1
    assert balanced_positions(5, 100) == [1, 2, 3, 4, 5]


def test_block_positions():
    assert block_positions(200, 64) == [64, 128, 192]
    assert block_positions(63, 64) == []
    assert block_positions(128, 64) == [64, 128]


def test_log_positions_are_denser_near_the_end():
    positions = log_positions(4096, 8)
    assert positions[-1] == 4096 and len(positions) == 8 and positions[0] >= 1
    gaps = np.diff(positions)
    assert np.all(np.diff(gaps) <= 0)  # gaps shrink towards the end
    assert log_positions(3, 10) == [1, 2, 3]


@pytest.mark.parametrize("heuristic", [balanced_positions, block_positions, log_positions])
@pytest.mark.parametrize(("length", "count"), [(0, 4), (10, 0), (10.0, 2), (10, None)])
def test_heuristics_refuse_bad_input(heuristic, length, count):
    with pytest.raises(InvalidInputError):
        heuristic(length, count)


def test_histogram_counts_decay_per_observation():
    histogram = OverlapHistogram(max_len=100, decay=0.5)
    for depth in (10, 20, 10, 500):
        histogram.observe(depth)
    expected = np.zeros(101)
    expected[10], expected[20], expected[100] = 0.5**3 + 0.5, 0.5**2, 1.0
    np.testing.assert_allclose(histogram.counts, expected)


def test_histogram_survives_many_observations_with_fast_decay():
    histogram = OverlapHistogram(max_len=10, decay=0.1)
    for _ in range(1000):
        histogram.observe(3)
    histogram.observe(7)
    counts = histogram.counts
    assert np.isfinite(counts).all() and counts[7] == pytest.approx(1.0) and counts[3] == pytest.approx(1 / 9)


def brute_force_block_aligned(hist, length, block, budget):
    """Token-level expected recompute, best over every block-aligned placement."""
    marks = range(block, length + 1, block)
    subsets = (s for size in range(budget + 1) for s in combinations(marks, size))
    return min(expected_recompute(hist, s) for s in subsets)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=30), st.integers(10, 45), st.integers(1, 3))
def test_histogram_block_dp_is_optimal_among_block_aligned_placements(depths, length, budget):
    block = 4
    histogram = OverlapHistogram(max_len=50, decay=0.9, block=block)
    for depth in depths:
        histogram.observe(depth)
    positions = histogram.positions(length, budget)
    assert all(p % block == 0 and block <= p <= length for p in positions) and len(positions) <= budget
    folded = histogram.counts[: length + 1].copy()
    folded[length] += histogram.counts[length + 1 :].sum()
    assert expected_recompute(folded, positions) == pytest.approx(
        brute_force_block_aligned(folded, length, block, budget), abs=1e-9
    )


def test_histogram_without_observations_is_balanced_over_blocks():
    histogram = OverlapHistogram(max_len=4096)
    blocks = [p // 64 for p in histogram.positions(640, 4)]
    uniform = np.ones(11)  # block depths 0..10; balanced spacing ties with other equally good ones
    assert expected_recompute(uniform, blocks) == pytest.approx(expected_recompute(uniform, balanced_positions(10, 4)))
    assert histogram.positions(63, 4) == []


def test_histogram_resolves_every_ten_observations():
    histogram, fresh = OverlapHistogram(max_len=1024, decay=0.5), OverlapHistogram(max_len=1024, decay=0.5)
    for depth in [900] * 10 + [128] * 9:
        histogram.observe(depth)
        fresh.observe(depth)
        if histogram.observations == 10:
            first = histogram.positions(1024, 1)
            assert first == [896]
    assert fresh.positions(1024, 1) == [128]  # the recent mass at 128 now dominates ...
    assert histogram.positions(1024, 1) is first  # ... but the cached answer stands until the 20th observation
    histogram.observe(128)
    assert histogram.positions(1024, 1) == [128]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"max_len": 0}, "max_len"), ({"max_len": 10, "decay": 0.0}, "decay"), ({"max_len": 10, "decay": 1.5}, "decay"),
     ({"max_len": 10, "block": 0}, "block"), ({"max_len": 10, "decay": "0.9"}, "decay")],
)
def test_histogram_refuses_bad_settings(kwargs, argument):
    with pytest.raises(InvalidInputError, match=argument):
        OverlapHistogram(**kwargs)


def test_histogram_refuses_bad_observations_and_stays_unchanged():
    histogram = OverlapHistogram(max_len=10)
    histogram.observe(4)
    before = histogram.counts
    for bad in (-1, 2.5, None, True):
        with pytest.raises(InvalidInputError, match="overlap_depth"):
            histogram.observe(bad)
    np.testing.assert_array_equal(histogram.counts, before)
    assert histogram.observations == 1
    with pytest.raises(InvalidInputError, match="budget"):
        histogram.positions(10, 0)


def test_table_solves_layers_when_read():
    """PlacementTable solves a layer when first read; what it reads equals what solving every layer gives."""
    rng = np.random.default_rng(5)
    hist = rng.random(300) * (rng.random(300) < 0.2)
    lazy, full = placement.PlacementTable(hist, 16), placement.PlacementTable(hist, 16)
    full.curve(0)  # every layer
    assert lazy.cost(2, 150) == full.cost(2, 150) and len(lazy._dp.choices) == 2 < lazy.layers == full.layers
    assert lazy.positions(2, 150) == full.positions(2, 150)
    _, costs, _ = placement._tables(hist, 16, placement._layer)
    for j in (0, 10, 150, 299, 400):
        assert np.array_equal(lazy.curve(j), np.maximum([F[min(j, 300)] for F in costs], 0.0) * hist.sum())


def test_a_table_read_by_several_threads_at_once_solves_each_layer_once():
    # the alpha tuner's background replays and the live store read the same solved tables (cache/law.py _TABLES)
    import sys
    import threading

    from prefixlab.cache.placement import PlacementTable

    rng = np.random.default_rng(0)
    hists = [rng.integers(0, 50, 400).astype(np.float64) for _ in range(20)]
    expected = [[PlacementTable(h, 16).cost(m, 399) for m in range(17)] for h in hists]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for hist, want in zip(hists, expected, strict=True):
            table, barrier, got = PlacementTable(hist, 16), threading.Barrier(4), []

            def read(table=table, barrier=barrier, got=got):
                barrier.wait()
                got.append([table.cost(m, 399) for m in range(17)] + [table.positions(16, 399)])

            threads = [threading.Thread(target=read) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert all(row[:-1] == want for row in got) and len({tuple(row[-1]) for row in got}) == 1
    finally:
        sys.setswitchinterval(interval)
