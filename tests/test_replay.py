"""simulate / ceiling: metrics against hand computations and the infinite-cache bound, progress, bad input."""

import numpy as np
import pytest
from prefix_helpers import tiny_spec

from prefixlab.cache.policies import POLICY_NAMES
from prefixlab.errors import InvalidInputError
from prefixlab.sim.replay import ceiling, simulate
from prefixlab.sim.trace import Request


def _conversations(sessions=8, turns=4, seed=0):
    rng = np.random.default_rng(seed)
    requests = []
    for s in range(sessions):
        history = rng.integers(0, 3, 3)  # a few shared opening tokens, like a chat template
        for t in range(turns):
            inp = np.concatenate([history, rng.integers(0, 100, rng.integers(3, 30))])
            out = rng.integers(0, 100, rng.integers(3, 30))
            requests.append(Request(str(s), t, s + 2.5 * t, inp, out))
            history = np.concatenate([inp, out])
    return sorted(requests, key=lambda r: r.ts)


def test_two_turn_conversation_metrics_by_hand():
    spec = tiny_spec()
    turn1 = Request("s", 0, 0.0, np.arange(10), np.arange(10, 15))
    turn2 = Request("s", 1, 1.0, np.arange(20), np.arange(20, 22))
    result = simulate([turn1, turn2], "sglang+", 10**6, spec)
    assert (result.input_tokens, result.reused_tokens) == (30, 15)
    assert result.token_hit_rate == pytest.approx(50.0) and result.request_hit_rate == pytest.approx(50.0)
    assert result.flops_saved == pytest.approx(spec.prefill_flops(15))
    ttft = [spec.prefill_seconds(10), spec.prefill_seconds(5, 15)]
    assert result.ttft_p50_s == pytest.approx(np.percentile(ttft, 50))
    assert result.ttft_p95_s == pytest.approx(np.percentile(ttft, 95))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_no_policy_beats_the_ceiling(policy):
    requests, spec = _conversations(), tiny_spec()
    bound = ceiling(requests, spec).token_hit_rate
    for capacity in (400, 3000, 10**7):
        assert 0 <= simulate(requests, policy, capacity, spec).token_hit_rate <= bound + 1e-9


def test_kv_only_model_with_unbounded_cache_reaches_the_ceiling():
    requests, spec = _conversations(), tiny_spec(hybrid=False)
    assert simulate(requests, "sglang+", 10**9, spec).reused_tokens == ceiling(requests, spec).reused_tokens > 0


def test_more_capacity_never_hurts_lru_on_conversations():
    requests, spec = _conversations(12, 5), tiny_spec()
    rates = [simulate(requests, "sglang+", c, spec).token_hit_rate for c in (500, 2000, 8000, 10**7)]
    assert rates == sorted(rates) and rates[-1] > rates[0]


def test_strict_budget_never_beats_marconi_overflow():
    requests, spec = _conversations(12, 5), tiny_spec()
    strict = simulate(requests, "vllm+", 700, spec, block_size=4, overflow=False)
    lenient = simulate(requests, "vllm+", 700, spec, block_size=4, overflow=True)
    assert strict.reused_tokens <= lenient.reused_tokens


def test_progress_is_called_once_per_request():
    calls = []
    requests = _conversations(3, 2)
    simulate(requests, "marconi", 10**6, tiny_spec(), progress=calls.append)
    assert calls == [1] * len(requests)


@pytest.mark.parametrize(
    ("requests", "policy", "capacity", "message"),
    [
        ([np.arange(3)], "marconi", 1000, "requests"),
        ("trace.jsonl", "marconi", 1000, "requests"),
        ([], "lru", 1000, "policy"),
        ([], "marconi", 0, "capacity_bytes"),
    ],
)
def test_bad_input(requests, policy, capacity, message):
    with pytest.raises(InvalidInputError, match=message):
        simulate(requests, policy, capacity, tiny_spec())


@pytest.mark.parametrize("tokens", [np.array([1.0, 2.0]), np.array([3, -1])])
def test_ceiling_checks_tokens_as_simulate_does(tokens):
    from prefixlab.sim.trace import Request

    requests = [Request("a", 0, 0.0, np.arange(4)), Request("b", 0, 1.0, tokens)]
    for replay in (lambda: simulate(requests, "marconi", 10**9, tiny_spec()), lambda: ceiling(requests, tiny_spec())):
        with pytest.raises(InvalidInputError, match=r"input_tokens"):
            replay()


@pytest.mark.parametrize("gb", [0.5, 2])
def test_dp_is_within_half_a_point_of_marconi_on_a_chat_and_prompt_versions_mix(gb):
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.sim.build import builtin_trace

    trace, spec = builtin_trace(), ModelSpec.from_name("marconi-7b")
    marconi = simulate(trace, "marconi", int(gb * 1e9), spec).token_hit_rate
    assert simulate(trace, "dp", int(gb * 1e9), spec).token_hit_rate >= marconi - 0.5  # issue 9's bar


@pytest.mark.parametrize("policy", ["marconi", "dp"])
def test_the_alpha_tuners_time_is_reported_as_part_of_the_replays(policy):
    requests, spec = _conversations(12, 5), tiny_spec()
    tuned = simulate(requests, policy, 700, spec)
    assert tuned.alpha is not None and 0 < tuned.tuning_seconds <= tuned.replay_seconds
    assert simulate(requests, policy, 700, spec, alpha=0.5).tuning_seconds == 0.0  # a fixed alpha is never tuned
    assert simulate(requests, policy, 10**9, spec).tuning_seconds == 0.0  # nothing evicted: no window, no tuning


def test_a_fleet_reports_its_replicas_alpha_and_tuning_time():
    """simulate_fleet left alpha None and tuning_seconds 0 although every replica tuned: one replica disagreed with
    the single cache it is."""
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.sim.build import builtin_trace
    from prefixlab.sim.replay import simulate_fleet

    requests, spec = builtin_trace(), ModelSpec.from_name("marconi-7b")
    one = simulate(requests, "dp", int(1e9), spec)
    fleet, _ = simulate_fleet(requests, "dp", int(1e9), spec, 1, "round-robin")
    assert one.alpha is not None and fleet.alpha == one.alpha and fleet.evictions == one.evictions
    assert fleet.tuning_seconds > 0


@pytest.mark.parametrize(("family", "policy", "kv_tokens", "seed"), [
    ("qwen3_5", "dp", 60, 1), ("qwen3_5", "marconi", 60, 2), ("qwen3_5", "dp", 200, 3),
    ("glm5_next", "dp", 60, 1),  # a DSA model: nothing past store.admit_limit is held (spec.reuse_limit)
])
def test_as_store_replays_what_a_patched_prefix_store_reuses_and_evicts(family, policy, kv_tokens, seed):
    """A PrefixStore resumes at most all but a prompt's last token, captures the state there (where a repeat
    resumes), plans over the prompt only and admits the tokens it fed (not the last output token). The plain
    replay models none of it: on this stream it reused up to 36 tokens more and 23 fewer than the store on one
    request, with 30 evictions where the store made 54. `as_store=True` replays the store's calls."""
    import warnings

    import hf_models
    import torch

    from prefixlab import HybridPrefixCache, PrefixStore
    from prefixlab.cache.costmodel import ModelSpec

    model = hf_models.build(family)
    spec = ModelSpec.from_config(model.config, torch.float32)
    capacity = 2 * spec.state_bytes + kv_tokens * spec.kv_bytes_per_token
    store = PrefixStore(model, capacity=capacity, policy=policy, tuning_lag_requests=0)
    rng, vocab = np.random.default_rng(seed), model.config.vocab_size
    systems, histories, requests, reused = [rng.integers(1, vocab, rng.integers(5, 40)) for _ in range(3)], {}, [], []
    for i in range(20):
        session = int(rng.integers(0, 5))
        if session in histories and rng.random() < 0.6:
            prompt = np.concatenate([histories[session], rng.integers(1, vocab, rng.integers(1, 8))])
        else:
            prompt = np.concatenate([systems[session % 3], rng.integers(1, vocab, rng.integers(1, 10))])
        ids, new = torch.tensor(prompt[None]), int(rng.integers(1, 6))
        cache = HybridPrefixCache(store)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (entries that do not fit: the store says so)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        histories[session] = out[0].numpy()
        reused.append(cache.reused_tokens)
        requests.append(Request(str(session), i, float(i), prompt, out[0, len(prompt):].numpy()))
    evictions = store.stats()["evictions"]
    store.close()
    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.sim.replay import replay_hits

    core = PrefixCacheCore(capacity, policy, spec, 32, overflow=False, tuning_lag_requests=0)
    assert replay_hits(requests, core, as_store=True).tolist() == reused and core.evictions == evictions


def test_an_as_store_fleet_routes_on_what_a_store_resumes():
    """A store resumes at most all but a prompt's last token, so an affinity router asking the replicas must hear
    that (as `prefixlab run`'s ProcessStore answers); the as_store fleet asked the cores for whole prompts, routing
    otherwise than a fleet of stores does (other hits on 95 of 200 random traces)."""
    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.cache.replay import replay_request
    from prefixlab.fleet.router import make_router
    from prefixlab.sim.replay import simulate_fleet

    rng, spec = np.random.default_rng(0), tiny_spec()
    prefixes = [rng.integers(0, 3, rng.integers(2, 20)) for _ in range(3)]
    requests = []
    for i in range(30):
        prompt = np.concatenate([prefixes[rng.integers(3)], rng.integers(0, 3, rng.integers(0, 4))])
        requests.append(Request("s", i, float(i), prompt, rng.integers(0, 3, rng.integers(0, 4))))

    class AsStore:  # what a PrefixStore would resume of a prompt (hf_resume: all but its last token)
        def __init__(self, core):
            self.core = core

        def peek(self, tokens):
            return self.core.peek(tokens, limit=max(len(tokens) - 1, 0))

    cores = [PrefixCacheCore(700, "marconi", spec, 32, overflow=False) for _ in range(2)]
    router, reused = make_router("affinity", 2, 0, caches=[AsStore(core) for core in cores]), 0
    for request in requests:
        replica = router.choose(request.input_tokens).replica
        hit = replay_request(cores[replica], request.input_tokens, request.output_tokens, as_store=True)
        router.record(replica, request.tokens, len(request.input_tokens) - hit)
        reused += hit
    result, loads = simulate_fleet(requests, "marconi", 700, spec, 2, "affinity", overflow=False, as_store=True)
    assert (result.reused_tokens, loads.tolist()) == (reused, router.loads.tolist())
