"""Placement DP speed: growth in N*M and the speedup over the textbook O(N^2 M) numpy DP (`make bench`)."""

import time

import numpy as np
import pytest

from prefixlab.cache.placement import solve_placement

SIZES = [(1024, 8), (2048, 8), (4096, 8), (1024, 32), (2048, 32), (4096, 32)]


def overlap_hist(n_positions: int) -> np.ndarray:
    """A multi-turn-like law: mass near the end (continuations) plus a shared-prefix bump and a noisy floor."""
    rng = np.random.default_rng(n_positions)
    depth = np.arange(n_positions + 1)
    return np.exp((depth - n_positions) / (n_positions / 8)) + 0.5 * np.exp(-((depth - 300) / 40.0) ** 2) + (
        0.05 * rng.random(n_positions + 1)
    )


def naive_cost_curve(hist: np.ndarray, budget: int) -> np.ndarray:
    """Textbook DP, O(N^2) per checkpoint: F_m(j) = min(F_{m-1}(j), min_{k<j} F_{m-1}(k) + C(k, j)) with
    C(k, j) = sum_{k<=i<j} hist[i] (i - k) from prefix sums, on a dense (k, j) matrix."""
    probs = hist / hist.sum()
    n = probs.size
    W = np.concatenate([[0.0], np.cumsum(probs)])
    V = np.concatenate([[0.0], np.cumsum(np.arange(n) * probs)])
    k = np.arange(n)[:, None]
    cost = (V[None, :] - V[:n, None]) - k * (W[None, :] - W[:n, None])
    cost[k >= np.arange(n + 1)[None, :]] = np.inf
    F, curve = V.copy(), [V[n]]
    for _ in range(budget):
        F = np.minimum(F, (F[:n, None] + cost).min(axis=0))
        curve.append(F[n])
    return np.array(curve)


def best_of(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize(("n_positions", "budget"), SIZES)
def test_solve_placement(benchmark, n_positions, budget):
    hist = overlap_hist(n_positions)
    result = benchmark(solve_placement, hist, budget)
    assert len(result.positions) == budget and np.all(np.diff(result.cost_curve) <= 1e-12)
    if benchmark.stats is not None:
        mean_s, cells = benchmark.stats.stats.mean, n_positions * budget
        per_cell_ns = mean_s / cells * 1e9
        print(f"\nsolve_placement N={n_positions} M={budget}: {mean_s * 1e3:.2f} ms mean, {per_cell_ns:.0f} ns per N*M")


def test_growth_and_speedup_over_naive(benchmark):
    """One table: best-of-5 time per (N, M) and per N*M cell; then naive vs fast at N=4096, M=32 in one run."""
    if benchmark.disabled:
        pytest.skip("timing table only with --benchmark-enable (make bench)")
    print("\n     N    M   fast ms   ns/(N*M)")
    for n_positions, budget in SIZES:
        seconds = best_of(5, solve_placement, overlap_hist(n_positions), budget)
        print(f"{n_positions:6d} {budget:4d} {seconds * 1e3:9.2f} {seconds / (n_positions * budget) * 1e9:10.0f}")
    hist = overlap_hist(4096)
    start = time.perf_counter()
    naive = naive_cost_curve(hist, 32)
    naive_s = time.perf_counter() - start
    fast = benchmark.pedantic(solve_placement, args=(hist, 32), rounds=5, iterations=1)
    np.testing.assert_allclose(fast.cost_curve, naive, rtol=1e-9, atol=1e-12)
    fast_s = benchmark.stats.stats.min
    print(f"N=4096 M=32: naive O(N^2 M) {naive_s * 1e3:.0f} ms, fast {fast_s * 1e3:.2f} ms, "
          f"speedup {naive_s / fast_s:.0f}x (same cost curve)")


def test_naive_reference_agrees_on_a_small_case():
    """Keeps the naive DP honest in plain test runs."""
    hist = overlap_hist(200)
    np.testing.assert_allclose(solve_placement(hist, 6).cost_curve, naive_cost_curve(hist, 6), rtol=1e-9, atol=1e-12)
