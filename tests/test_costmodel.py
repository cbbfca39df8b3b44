"""Cost model: Marconi's accounting reproduced, FLOP algebra, vectorised calls, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.cache.costmodel import LayerGroup, ModelSpec
from prefixlab.errors import InvalidInputError, UnsupportedModelError

MARCONI = ModelSpec.from_name("marconi-7b")


def marconi_paper_flops(length: int, d: int = 4096, n: int = 128) -> int:
    """Marconi Appendix A totals for the 7B hybrid, written out term by term (integer arithmetic)."""
    mamba = 12 * length * d**2 + 16 * length * d * n + 10 * length * d
    attention = 8 * length * d**2 + 4 * length**2 * d
    mlp = 16 * length * d**2
    return 24 * mamba + 4 * attention + 28 * mlp


def test_marconi_bytes_match_paper():
    d, n = 4096, 128
    assert MARCONI.kv_bytes_per_token == 4 * (2 * d * 2)
    assert MARCONI.state_bytes == 24 * (d * n * 2 + (2 * d + 2 * n) * 4 * 2)
    assert MARCONI.dtype_bytes == 2
    assert (MARCONI.layer_count("mamba2"), MARCONI.layer_count("attention"), MARCONI.layer_count("mlp")) == (24, 4, 28)


@pytest.mark.parametrize("length", [1, 17, 1000, 8192, 100_000])
def test_marconi_flops_and_efficiency_match_paper(length):
    expected = marconi_paper_flops(length)
    assert MARCONI.prefill_flops(length) == pytest.approx(expected, rel=1e-12)
    assert MARCONI.flops_saved(length) == pytest.approx(expected, rel=1e-12)
    paper_bytes = MARCONI.state_bytes + 4 * 2 * length * 4096 * 2
    assert MARCONI.flop_efficiency(length) == pytest.approx(expected / paper_bytes, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 50_000), st.integers(0, 50_000))
def test_prefill_flops_add_up_along_a_prefix(first, second):
    whole = MARCONI.prefill_flops(first + second)
    assert MARCONI.prefill_flops(first) + MARCONI.prefill_flops(second, first) == pytest.approx(whole, rel=1e-12)


def test_attention_makes_resumed_prefill_cost_more_than_fresh():
    assert MARCONI.prefill_flops(100, n_past=10_000) > MARCONI.prefill_flops(100)
    assert MARCONI.prefill_flops(0, n_past=10_000) == 0.0


def test_vectorised_matches_scalar():
    new = np.array([0, 1, 5, 4096, 70_000])
    past = np.array([3, 0, 100, 4096, 1])
    flops = MARCONI.prefill_flops(new, past)
    assert flops.dtype == np.float64
    one_by_one = [MARCONI.prefill_flops(int(a), int(b)) for a, b in zip(new, past, strict=True)]
    np.testing.assert_allclose(flops, one_by_one, rtol=1e-12)
    seconds = MARCONI.prefill_seconds(new, past)
    np.testing.assert_allclose(seconds, flops / MARCONI.effective_flops_per_second, rtol=1e-12)
    np.testing.assert_allclose(MARCONI.entry_bytes(new), MARCONI.state_bytes + MARCONI.kv_bytes_per_token * new)


def test_prefill_seconds_is_flops_over_throughput():
    assert MARCONI.prefill_seconds(2048, 512) == MARCONI.prefill_flops(2048, 512) / MARCONI.effective_flops_per_second


@pytest.mark.parametrize(
    ("n_new", "n_past", "argument"),
    [(-1, 0, "n_new"), (3, -2, "n_past"), (1.5, 0, "n_new"), (True, 0, "n_new"), ("3", 0, "n_new"),
     (np.array([1, -1]), 0, "n_new"), (np.array([1.0]), 0, "n_new")],
)
def test_bad_token_counts_raise_naming_the_argument(n_new, n_past, argument):
    with pytest.raises(InvalidInputError, match=argument):
        MARCONI.prefill_flops(n_new, n_past)


def test_unknown_name_lists_built_ins():
    with pytest.raises(UnsupportedModelError, match="marconi-7b"):
        ModelSpec.from_name("llama-9000")


def test_bad_specs_are_refused():
    with pytest.raises(InvalidInputError, match="kind"):
        LayerGroup("transformer", 1, 1.0)
    with pytest.raises(InvalidInputError, match="no layers"):
        ModelSpec("empty", 8, 2, ())
    with pytest.raises(InvalidInputError, match="effective_flops_per_second"):
        ModelSpec("slow", 8, 2, (LayerGroup("mlp", 1, 1.0),), effective_flops_per_second=0)
    with pytest.raises(InvalidInputError, match="hidden_size"):
        ModelSpec("hollow", 0, 2, (LayerGroup("mlp", 1, 1.0),))
    with pytest.raises(InvalidInputError, match="count"):
        LayerGroup("mlp", -1, 1.0)
    with pytest.raises(InvalidInputError, match="kind"):
        MARCONI.layer_count("conv1d")


def test_negative_costs_and_sizes_are_refused():
    with pytest.raises(InvalidInputError, match="linear_flops_per_token"):
        LayerGroup("mlp", 1, -1.0)
    with pytest.raises(InvalidInputError, match="state_bytes"):
        LayerGroup("mamba2", 1, 1.0, state_bytes=-8)
    with pytest.raises(InvalidInputError, match="pair_flops"):
        LayerGroup("attention", 1, 1.0, pair_flops=float("nan"))
    with pytest.raises(InvalidInputError, match="hidden=0"):
        LayerGroup("mlp", 1, 1.0, dims=(("hidden", 0),))
    assert LayerGroup("moe", 0, 1.0, dims=(("experts", 0),)).count == 0  # no layers: their dims do not matter


@pytest.mark.parametrize("field, value", [("linear_flops_per_token", float("inf")), ("pair_flops", float("inf")),
                                          ("state_bytes", float("inf")), ("state_bytes", 1.5),
                                          ("kv_bytes_per_token", 2.0), ("count", 1.5), ("count", True)])
def test_costs_must_be_finite_and_sizes_ints(field, value):
    """An infinite FLOP cost made 0 x inf = NaN FLOPs saved (a miss) and NaN prices; a float byte size made states
    whose payloads a strict replay refuses mid-trace."""
    kwargs = {"kind": "mamba2", "count": 1, "linear_flops_per_token": 1.0, field: value}
    with pytest.raises(InvalidInputError, match=field):
        LayerGroup(**kwargs)


@pytest.mark.parametrize("throughput", [float("nan"), float("inf"), "1e15", True])
def test_throughput_must_be_a_finite_positive_number(throughput):
    """(NaN passed the `<= 0` check and made every TTFT NaN; inf made every TTFT 0.)"""
    with pytest.raises(InvalidInputError, match="effective_flops_per_second"):
        ModelSpec("x", 8, 2, (LayerGroup("mlp", 1, 1.0),), effective_flops_per_second=throughput)


@pytest.mark.parametrize("limit", [-1, 1.5, "8", True])
def test_reuse_limit_must_be_none_or_an_int_at_least_zero(limit):
    """(A negative limit cut that many tokens off every sequence's end: tokens[:-1].)"""
    with pytest.raises(InvalidInputError, match="reuse_limit"):
        ModelSpec("x", 8, 2, (LayerGroup("mlp", 1, 1.0),), reuse_limit=limit)
    assert ModelSpec("x", 8, 2, (LayerGroup("mlp", 1, 1.0),), reuse_limit=np.int64(0)).reuse_limit == 0


@pytest.mark.parametrize("size", ["hidden_size", "dtype_bytes"])
def test_model_sizes_must_be_ints(size):
    kwargs = {"name": "x", "hidden_size": 8, "dtype_bytes": 2, "layers": (LayerGroup("mlp", 1, 1.0),), size: "8"}
    with pytest.raises(InvalidInputError, match=size):
        ModelSpec(**kwargs)


def test_totals_that_overflow_a_float_are_refused():
    """(Finite per-layer costs whose sum is inf made every FLOP count, efficiency and price inf or NaN.)"""
    with pytest.raises(InvalidInputError, match="linear_flops_per_token"):
        ModelSpec("x", 8, 2, (LayerGroup("mlp", 4, 1e308),))
    with pytest.raises(InvalidInputError, match="state_bytes"):
        ModelSpec("x", 8, 2, (LayerGroup("mamba2", 2, 1.0, state_bytes=10**400),))
