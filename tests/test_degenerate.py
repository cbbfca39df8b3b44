"""Degenerate input to the simulator's Python API (issue 9's bar): empty outputs given as lists, one-token prompts,
bad fleet sizes, seeds, flags and progress callbacks run sensibly or are refused with InvalidInputError."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_helpers import tiny_spec

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.errors import InvalidInputError
from prefixlab.fleet.router import make_router
from prefixlab.sim.replay import ceiling, replay_hits, simulate, simulate_fleet
from prefixlab.sim.trace import Request

ROUTINGS = ("random", "round-robin", "affinity")


def _lists_with_empty_outputs():
    """Requests built from Python lists, outputs empty (np.concatenate of [1, 2] and [] is a float array)."""
    return [Request("a", 0, 0.0, [1, 2, 3], []), Request("b", 0, 1.0, [1, 2, 3, 4], []), Request("c", 0, 2.0, [7], [])]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("as_store", [False, True])
def test_a_fleet_replays_list_requests_with_empty_outputs_as_one_cache_does(routing, as_store):
    requests, spec = _lists_with_empty_outputs(), tiny_spec()
    one = simulate(requests, "dp", 10**6, spec, overflow=not as_store, as_store=as_store)
    fleet, loads = simulate_fleet(requests, "dp", 10**6, spec, 1, routing, overflow=not as_store, as_store=as_store)
    assert fleet.reused_tokens == one.reused_tokens and fleet.token_hit_rate == one.token_hit_rate
    assert loads.tolist() == [one.input_tokens - one.reused_tokens]


def test_a_fleet_names_the_request_whose_tokens_are_bad():
    requests = [Request("a", 0, 0.0, [1, 2], [3]), Request("b", 0, 1.0, [1, 2.5], [])]
    with pytest.raises(InvalidInputError, match=r"requests\[1\]\.input_tokens"):
        simulate_fleet(requests, "dp", 10**6, tiny_spec(), 1, "affinity")


@pytest.mark.parametrize("replicas", [1.5, None, "2", 0, -1, True])
def test_a_fleet_size_that_is_not_a_positive_int_is_refused(replicas):
    with pytest.raises(InvalidInputError, match="replicas"):
        simulate_fleet(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), replicas, "random")


def test_more_replicas_than_requests_is_refused_before_any_cache_is_built():
    """(The CLI's rule: a million replicas for three requests built a million caches and ran out of memory.)"""
    with pytest.raises(InvalidInputError, match="at most 3 replicas"):
        simulate_fleet(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), 10**9, "random")
    result, loads = simulate_fleet([], "dp", 10**6, tiny_spec(), 1, "random")  # an empty trace: one idle replica
    assert result.requests == 0 and loads.tolist() == [0]


@pytest.mark.parametrize("seed", [-1, 1.5, "x", None, True, 2**64])
def test_a_router_seed_that_is_not_an_int_in_range_is_refused(seed):
    with pytest.raises(InvalidInputError, match="seed"):
        make_router("random", 2, seed)
    with pytest.raises(InvalidInputError, match="seed"):
        simulate_fleet(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), 2, "random", seed=seed)


@pytest.mark.parametrize("overflow", ["no", 0, None, 1.0])
def test_overflow_must_be_a_bool(overflow):
    with pytest.raises(InvalidInputError, match="overflow"):
        PrefixCacheCore(10**6, "dp", tiny_spec(), overflow=overflow)
    with pytest.raises(InvalidInputError, match="overflow"):
        simulate(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), overflow=overflow)
    PrefixCacheCore(10**6, "dp", tiny_spec(), overflow=np.True_)  # numpy's bools are bools


@pytest.mark.parametrize("fleet", [False, True])
def test_a_progress_that_is_not_callable_is_refused_before_replaying(fleet):
    def run(progress):
        if fleet:
            return simulate_fleet(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), 1, "random", progress)
        return simulate(_lists_with_empty_outputs(), "dp", 10**6, tiny_spec(), progress)

    with pytest.raises(InvalidInputError, match="progress"):
        run(3)
    calls = []
    run(calls.append)
    assert calls == [1, 1, 1]


def test_balance_eps_refuses_a_bool():
    with pytest.raises(InvalidInputError, match="balance_eps"):
        make_router("affinity", 2, balance_eps=True)


POLICIES = ("vllm+", "sglang+", "marconi", "dp", "marconi+balanced", "marconi+block", "marconi+log")
_TOKENS = st.lists(st.integers(0, 3), max_size=8)  # a tiny alphabet: prompts repeat, share and diverge often


@st.composite
def degenerate_traces(draw):
    """1-6 requests: empty, one-token and repeated prompts, empty outputs, next turns of earlier requests."""
    requests = []
    for k in range(draw(st.integers(1, 6))):
        if requests and draw(st.booleans()):  # a next turn, or the very same prompt again
            earlier = draw(st.sampled_from(requests))
            prompt = [*earlier.input_tokens.tolist(), *earlier.output_tokens.tolist(), *draw(_TOKENS)]
            prompt = prompt if draw(st.booleans()) else earlier.input_tokens.tolist()
        else:
            prompt = draw(_TOKENS)
        requests.append(Request(str(k), 0, float(k), np.array(prompt, dtype=np.int64),
                                np.array(draw(st.lists(st.integers(0, 3), max_size=3)), dtype=np.int64)))
    return requests


@settings(max_examples=60, deadline=None)
@given(degenerate_traces(), st.sampled_from(POLICIES), st.sampled_from([1, 60, 100, 104, 500, 10**6]),
       st.sampled_from(["overflow", "strict", "store"]), st.sampled_from([0, 1, 3]))
def test_any_small_degenerate_trace_replays_sensibly(requests, policy, capacity, mode, lag):
    """Every policy, budget (below one 100-byte state, exactly one, a KV token more, huge) and replay mode runs;
    the hit rates are in [0, 100], every number finite, the reuse within the infinite-cache bound, a strict budget
    never exceeded after a request, a store never resuming a prompt's last token, and a fleet of one replica, however
    routed, the single cache it is."""
    spec, overflow, as_store = tiny_spec(), mode == "overflow", mode == "store"
    options = {"overflow": overflow, "tuning_lag_requests": lag, "as_store": as_store}
    result = simulate(requests, policy, capacity, spec, **options)
    numbers = [v for v in result.as_dict().values() if isinstance(v, int | float) and not isinstance(v, bool)]
    assert all(math.isfinite(v) for v in numbers), result
    assert 0 <= result.token_hit_rate <= 100 and 0 <= result.request_hit_rate <= 100
    assert result.reused_tokens <= ceiling(requests, spec).reused_tokens

    core = PrefixCacheCore(capacity, policy, spec, overflow=overflow, tuning_lag_requests=lag)
    held = []
    hits = replay_hits(requests, core, lambda _: held.append(core.used_bytes), as_store=as_store)
    assert hits.sum() == result.reused_tokens
    assert overflow or max(held) <= capacity
    if as_store:
        assert all(hit <= max(len(r.input_tokens) - 1, 0) for hit, r in zip(hits, requests, strict=True))
    for routing in ROUTINGS:
        fleet, loads = simulate_fleet(requests, policy, capacity, spec, 1, routing, **options)
        assert (fleet.reused_tokens, fleet.evictions) == (result.reused_tokens, result.evictions)
        assert loads.tolist() == [result.input_tokens - result.reused_tokens]
