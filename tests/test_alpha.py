"""Marconi's alpha tuning run inline (the simulator) or in the background (PrefixStore's default)."""

import threading

import numpy as np
import pytest
from prefix_helpers import tiny_spec

from prefixlab.cache.alpha import AlphaBootstrap
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.replay import replay_request
from prefixlab.errors import InvalidInputError


def _conversations(sessions=12, turns=5, seed=0):
    """(input, output) token arrays of interleaved multi-turn sessions, each turn extending the last."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(0, 3, 3) for _ in range(sessions)]
    requests = []
    for _ in range(turns):
        for s in range(sessions):
            prompt = np.concatenate([histories[s], rng.integers(0, 100, rng.integers(3, 30))])
            output = rng.integers(0, 100, rng.integers(3, 30))
            requests.append((prompt, output))
            histories[s] = np.concatenate([prompt, output])
    return requests


def _alphas(policy, lag, requests):
    """The core's alpha after each request, and the core."""
    core = PrefixCacheCore(700, policy, tiny_spec(), tuning_lag_requests=lag)
    alphas = []
    for prompt, output in requests:
        replay_request(core, prompt, output)
        alphas.append(core.alpha)
    return alphas, core


def _first_change(alphas):
    return next(i for i, alpha in enumerate(alphas) if alpha != alphas[0])


@pytest.mark.parametrize("policy", ["marconi", "dp"])
@pytest.mark.parametrize("lag", [1, 6])
def test_a_background_tuning_applies_the_inline_alpha_lag_admissions_later(policy, lag):
    requests = _conversations()
    inline, inline_core = _alphas(policy, 0, requests)
    background, core = _alphas(policy, lag, requests)
    due = _first_change(inline)
    assert due < len(requests) - lag  # the workload tunes, early enough to see the lagged one
    assert _first_change(background) == due + lag and background[due + lag] == inline[due]
    assert inline_core.tuning_wait_seconds == inline_core.tuning_seconds > 0
    assert core.tuning_seconds > 0 and core.tuning_wait_seconds >= 0  # (the wait: whatever was left at the lag)
    again, _ = _alphas(policy, lag, requests)
    assert again == background  # where the alpha changes does not depend on the thread's timing


def test_the_admission_that_makes_a_tuning_due_does_not_wait_for_its_replays(monkeypatch):
    requests, lag = _conversations(), 3
    due = _first_change(_alphas("dp", 0, requests)[0])
    started, release, threads = threading.Event(), threading.Event(), []
    tune = AlphaBootstrap.tune

    def slow_tune(self, *args):
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30), "the test never released the tuning"
        return tune(self, *args)

    monkeypatch.setattr(AlphaBootstrap, "tune", slow_tune)
    core = PrefixCacheCore(700, "dp", tiny_spec(), tuning_lag_requests=lag)
    for prompt, output in requests[: due + lag]:  # the tuning is blocked: every one of these must return
        replay_request(core, prompt, output)
    assert started.wait(30) and threads[0].startswith("prefixlab-alpha") and core.alpha == 0.0
    release.set()
    replay_request(core, *requests[due + lag])  # its time has come: waits for the replays, then applies
    assert core.alpha == _alphas("dp", 0, requests)[0][due]


def test_with_no_lag_given_no_admission_waits_and_the_alpha_applies_once_found(monkeypatch):
    requests = _conversations()
    inline = _alphas("dp", 0, requests)[0]
    release = threading.Event()
    tune = AlphaBootstrap.tune
    monkeypatch.setattr(AlphaBootstrap, "tune", lambda self, *args: release.wait(30) and tune(self, *args))
    core = PrefixCacheCore(700, "dp", tiny_spec(), tuning_lag_requests=None)
    for prompt, output in requests[:-1]:  # the tuning stays blocked through all of these
        replay_request(core, prompt, output)
    assert core.alpha == 0.0 and core.tuning_wait_seconds == 0.0 and core.stats()["tuning_pending"]
    release.set()
    core.bootstrap.pending[0].result(timeout=30)
    replay_request(core, *requests[-1])
    assert core.alpha == inline[_first_change(inline)] and core.tuning_wait_seconds < core.tuning_seconds
    stats = core.stats()
    assert not stats["tuning_pending"] and stats["tuning_seconds"] == core.tuning_seconds > 0


@pytest.mark.parametrize("lag", [-1, True, 1.5, "8"])
def test_a_bad_tuning_lag_is_refused(lag):
    with pytest.raises(InvalidInputError, match="tuning_lag_requests must be None or an int >= 0"):
        PrefixCacheCore(700, "dp", tiny_spec(), tuning_lag_requests=lag)


def test_a_store_tunes_in_the_background_unless_told_otherwise():
    from hf_models import build

    from prefixlab import PrefixStore

    model = build("qwen3_5")
    store = PrefixStore(model, "1MB")
    assert store.options["tuning_lag_requests"] is None and store.core.bootstrap.lag_requests is None
    store.close()
    store = PrefixStore(model, "1MB", tuning_lag_requests=0)
    assert store.core.bootstrap.lag_requests == 0
    store.close()


def test_a_forked_child_runs_its_own_background_tunings():
    import multiprocessing

    from prefixlab.cache import alpha

    alpha._executor().submit(int).result()  # the parent's worker thread exists
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        child = pool.apply_async(_child_tunes_in_the_background)
        assert child.get(timeout=60) == _alphas("dp", 0, _conversations())[0][-1]  # (hangs without its thread)


def _child_tunes_in_the_background():
    alphas, core = _alphas("dp", 2, _conversations())  # an int lag waits for the job: it would hang without a thread
    return alphas[-1]


def test_a_store_refuses_a_bad_tuning_lag_and_leaves_the_model_as_it_was():
    from hf_models import build

    from prefixlab import PrefixStore
    from prefixlab.recurrent.patch import is_patched

    model = build("qwen3_5")
    with pytest.raises(InvalidInputError, match="tuning_lag_requests must be None or an int >= 0"):
        PrefixStore(model, "1MB", tuning_lag_requests=-3)
    assert not model._forward_hooks and not model._forward_pre_hooks and not is_patched(model)


@pytest.mark.parametrize("lag", [None, -2])
def test_a_replay_takes_only_a_deterministic_lag(lag):
    from prefixlab.sim.build import builtin_trace
    from prefixlab.sim.replay import simulate, simulate_fleet

    with pytest.raises(InvalidInputError, match="tuning_lag_requests must be"):
        simulate(builtin_trace(), "dp", 10**8, tiny_spec(), tuning_lag_requests=lag)
    with pytest.raises(InvalidInputError, match="tuning_lag_requests must be"):
        simulate_fleet(builtin_trace(), "dp", 10**8, tiny_spec(), 2, "affinity", tuning_lag_requests=lag)
