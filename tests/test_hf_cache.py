"""HybridPrefixCache behaviour on a tiny Qwen3.5-architecture hybrid (3 GatedDeltaNet : 1 attention, fp32):
batches, sampling, immutability of cached tensors, namespaces, failures mid-generate, bad input."""

import warnings

import pytest
import torch
from hf_models import build
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import InvalidInputError, ModelMismatchError

FAMILY = "qwen3_5"


@pytest.fixture(scope="module")
def model():
    return build(FAMILY)


def new_store(model, **options):
    return PrefixStore(model, **({"capacity": "64MB", "policy": "marconi", "block_size": 4} | options))


def tokens(*shape, seed=0):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


def generate(model, input_ids, cache=None, **kwargs):
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0) | kwargs
    return model.generate(input_ids, past_key_values=cache, **options)


def warm(model, store, prompt, namespace="default"):
    """Serve `prompt` twice, so the store holds its all-but-last-token state; returns the second cache."""
    generate(model, prompt, HybridPrefixCache(store, namespace))
    cache = HybridPrefixCache(store, namespace)
    generate(model, prompt, cache)
    return cache


def test_identical_prompt_reuses_all_but_its_last_token(model):
    store, prompt = new_store(model), tokens(1, 20)
    assert warm(model, store, prompt).reused_tokens == 19


def test_prompt_shorter_than_a_block_still_hits(model):
    store, prompt = new_store(model, block_size=32), tokens(1, 3)
    cache = warm(model, store, prompt)
    assert cache.reused_tokens == 2
    assert torch.equal(generate(model, prompt), generate(model, prompt, HybridPrefixCache(store)))


def test_prompts_diverging_mid_edge_both_keep_hitting(model):
    store = new_store(model)
    first = tokens(1, 30, seed=1)
    second = torch.cat([first[:, :17], tokens(1, 13, seed=2)], dim=1)  # diverges inside first's edge
    for prompt in (first, second, first, second):
        generate(model, prompt, HybridPrefixCache(store))
    for prompt in (first, second):
        cache = HybridPrefixCache(store)
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt))
        assert cache.reused_tokens == 29
    store.core.check_invariants()


def test_cached_tensors_are_bit_identical_after_100_hits(model):
    store, prompt = new_store(model), tokens(1, 16)
    warm(model, store, prompt)
    match = store.core.match(prompt[0, :15].tolist())
    saved = [t.clone() for t in (*match.state.conv.values(), *match.state.recurrent.values())]
    saved += [t.clone() for kv in match.kv for t in (*kv.keys.values(), *kv.values.values())]
    store.core.release(match)
    for seed in range(100):  # hits that go on with other tokens and decode past the cached prefix
        follow = torch.cat([prompt[:, :15], tokens(1, 2, seed=seed)], dim=1)
        generate(model, follow, HybridPrefixCache(store), max_new_tokens=2)
    match = store.core.match(prompt[0, :15].tolist())
    now = [*match.state.conv.values(), *match.state.recurrent.values()]
    now += [t for kv in match.kv for t in (*kv.keys.values(), *kv.values.values())]
    store.core.release(match)
    assert len(now) == len(saved) and all(torch.equal(a, b) for a, b in zip(saved, now, strict=True))


def test_batch_rows_share_the_common_prefix(model):
    store = new_store(model)
    system = tokens(1, 20, seed=3)
    batch = torch.cat([system.repeat(3, 1), tokens(3, 4, seed=4)], dim=1)
    warm(model, store, torch.cat([system, tokens(1, 4, seed=5)], dim=1))
    generate(model, torch.cat([system, tokens(1, 4, seed=6)], dim=1), HybridPrefixCache(store))  # branch at 20
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(model, batch, cache), generate(model, batch))
    assert cache.reused_tokens == 20
    for row in range(3):  # every row was admitted: each is now an identical-prompt hit
        cache = HybridPrefixCache(store)
        generate(model, batch[row:row + 1], cache)
        assert cache.reused_tokens == batch.shape[1] - 1


def test_batch_rows_resume_from_their_own_prefixes(model):
    """Rows under different system prompts (each cached) resume together from the common checkpoint position."""
    store = new_store(model)
    systems = [tokens(1, 20, seed=s) for s in (22, 23)]
    for system in systems:
        for seed in (24, 25):  # the second question captures the branch point at 20
            generate(model, torch.cat([system, tokens(1, 4, seed=seed)], dim=1), HybridPrefixCache(store))
    batch = torch.cat([torch.cat([system, tokens(1, 4, seed=26 + i)], dim=1) for i, system in enumerate(systems)])
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(model, batch, cache), generate(model, batch))
    assert cache.reused_tokens == 20
    store.core.check_invariants()


def test_left_padded_batch_without_a_common_column_primes_its_rows_and_is_exact(model):
    """Row 1 (3 pads) has nothing cached, so one common column would be <= 3, where row 0 has no checkpoint: no
    reuse (before align.py). Row 1 is prefilled alone up to the batch's column first: row 0 reuses its prefix."""
    store = new_store(model)
    prompt = tokens(2, 12, seed=7)
    warm(model, store, prompt[:1])
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    padded = prompt.clone()
    padded[1, :3] = 0
    cache = HybridPrefixCache(store)
    out = generate(model, padded, cache, attention_mask=mask)
    assert cache.rows_reused == [11, 0]
    assert torch.equal(out, generate(model, padded, attention_mask=mask))


def test_sampling_with_several_return_sequences_is_exact(model):
    store, prompt = new_store(model), tokens(1, 18, seed=8)
    warm(model, store, prompt)
    options = dict(do_sample=True, top_k=20, num_return_sequences=3, max_new_tokens=6)
    torch.manual_seed(11)
    reference = generate(model, prompt, **options)
    torch.manual_seed(11)
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(model, prompt, cache, **options), reference)
    assert cache.reused_tokens == 17


def test_namespaces_never_share_entries(model):
    store, prompt = new_store(model), tokens(1, 14, seed=9)
    warm(model, store, prompt, namespace="tenant-a")
    other = HybridPrefixCache(store, namespace="tenant-b")
    generate(model, prompt, other)
    assert other.reused_tokens == 0
    assert warm(model, store, prompt, namespace="tenant-a").reused_tokens == 13


def test_store_stats_report_hits_reused_tokens_and_bytes(model):
    store, prompt = new_store(model), tokens(1, 14, seed=10)
    warm(model, store, prompt)
    stats = store.stats()
    assert stats["sequences"] == 2 and stats["hit_sequences"] == 1 and stats["reused_tokens"] == 13
    assert stats["reused_bytes"] == 13 * store.spec.kv_bytes_per_token + store.spec.state_bytes
    assert 0 < stats["used_bytes"] <= store.capacity_bytes


def test_exception_mid_generate_leaves_store_consistent_and_cache_reusable(model):
    store, prompt = new_store(model), tokens(1, 16, seed=12)
    warm(model, store, prompt)
    calls = {"n": 0}

    def fail_on_third_forward(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")

    handle = model.model.layers[1].register_forward_pre_hook(fail_on_third_forward)
    cache = HybridPrefixCache(store)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate(model, prompt, cache)
    finally:
        handle.remove()
    store.core.check_invariants()
    assert store.core.stats()["locked_matches"] == 0
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt))  # same object, fresh request
    assert cache.reused_tokens == 15
    store.core.check_invariants()


def test_capacity_too_small_runs_uncached_with_a_warning(model):
    store, prompt = new_store(model, capacity=1024), tokens(1, 16, seed=13)
    with pytest.warns(RuntimeWarning, match="does not fit"):
        generate(model, prompt, HybridPrefixCache(store))
        store.flush()
    cache = HybridPrefixCache(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt))
    assert cache.reused_tokens == 0 and store.core.used_bytes == 0


def test_cache_of_another_models_store_is_refused(model):
    other = build("qwen3_5", seed=1)
    other.config.rms_norm_eps = 1e-5  # a different config
    foreign = HybridPrefixCache(new_store(other))
    new_store(model)  # this model's hooks see the foreign cache
    with pytest.raises(ModelMismatchError, match="config or dtype differ"):
        generate(model, tokens(1, 8), foreign)


def test_cache_used_by_a_model_without_store_is_refused(model):
    stranger = build("qwen3_5", seed=2)
    with pytest.raises(ModelMismatchError, match="not built for"):
        generate(stranger, tokens(1, 8), HybridPrefixCache(new_store(model)))



@pytest.mark.parametrize("stranger", ["qwen3_5", "llama"])
def test_a_used_cache_passed_to_a_model_without_its_store_is_refused(model, stranger):
    """A cache that served a request holds its tokens: another model's forward (no hooks of the cache's store) must
    not run over them (generate would cut the prompt to what the cache claims to hold)."""
    store = new_store(model)
    cache = HybridPrefixCache(store)
    generate(model, tokens(1, 8), cache)
    with pytest.raises(ModelMismatchError, match="hooks did not drive"):
        generate(build(stranger, seed=2), tokens(1, 8), cache)

def test_bad_arguments_raise_clear_errors(model):
    with pytest.raises(InvalidInputError, match="PrefixStore"):
        HybridPrefixCache(object())
    with pytest.raises(InvalidInputError, match="namespace"):
        HybridPrefixCache(new_store(model), namespace="")
    cache = HybridPrefixCache(new_store(model))
    with pytest.raises(InvalidInputError, match="input_ids"):
        model(inputs_embeds=torch.zeros(1, 4, 64), past_key_values=cache)


def test_for_model_builds_one_default_store():
    model = build(FAMILY)  # its own model: the default store is the model's first open store
    first = HybridPrefixCache.for_model(model, capacity="32MB", policy="marconi")
    second = HybridPrefixCache.for_model(model)
    assert first.store is second.store and first.store.capacity_bytes == 32 * 10**6
    prompt = tokens(1, 12, seed=14)
    generate(model, prompt, first)
    generate(model, prompt, HybridPrefixCache.for_model(model))
    third = HybridPrefixCache.for_model(model)
    generate(model, prompt, third)
    assert third.reused_tokens == 11
    with pytest.raises(InvalidInputError, match="default store was built with"):
        HybridPrefixCache.for_model(model, capacity="1GB")
    first.store.close()


def test_entries_evicted_from_the_device_are_served_from_the_host_tier(model):
    first, second = tokens(1, 40, seed=15), tokens(1, 40, seed=16)
    probe = new_store(model, capacity="16MB")
    warm(model, probe, first)
    entry_bytes = probe.stats()["used_bytes"]
    probe.close()
    # the device holds one entry, the host several
    store = new_store(model, capacity=entry_bytes + entry_bytes // 2, offload_capacity="16MB")
    warm(model, store, first)
    warm(model, store, second)  # evicts first's entry to the host tier
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["offload_used_bytes"] > 0
    cache = HybridPrefixCache(store)
    out = generate(model, first, cache)
    assert cache.reused_tokens == 39 and store.stats()["offload_hits"] == 1
    assert torch.equal(out, generate(model, first))
    store.core.check_invariants()


def test_offload_hits_count_the_rows_served_from_the_host_tier_once(model):
    """Before: every lookup that found more on the host counted, loaded or not, so a chunked prefill (a lookup per
    chunk) served from the host once counted 5 offload hits for 1 hit sequence. Now a row counts once, when its
    reuse was loaded from the host tier."""
    systems = [tokens(40, seed=20 + k).tolist() for k in range(3)]
    store = new_store(model, capacity="300KB", offload_capacity="64MB", policy="dp", block_size=32)
    for system in systems:  # the device holds two of these: the first goes to the host tier
        generate(model, torch.tensor([system + [5, 6]]), HybridPrefixCache(store))
    prompt = torch.tensor([systems[0] + [7, 8, 9]])
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(model, prompt, cache, prefill_chunk_size=8), generate(model, prompt))
    assert cache.report().rows[0].from_host and cache.reused_tokens > 0
    stats = store.stats()
    assert stats["offload_hits"] == stats["hit_sequences"] == 1
    store.close()


def test_without_a_host_tier_evicted_entries_are_gone(model):
    first, second = tokens(1, 40, seed=15), tokens(1, 40, seed=16)
    probe = new_store(model, capacity="16MB")
    warm(model, probe, first)
    entry_bytes = probe.stats()["used_bytes"]
    probe.close()
    store = new_store(model, capacity=entry_bytes + entry_bytes // 2)
    warm(model, store, first)
    warm(model, store, second)
    cache = HybridPrefixCache(store)
    generate(model, first, cache)
    assert cache.reused_tokens == 0


@pytest.mark.slow
def test_compiled_forward_reuses_exactly():
    """The store's hooks run around the module call, so a torch.compile'd forward (dynamo graph capture; the eager
    backend keeps the test fast, inductor only changes the kernels) still reuses exactly."""
    compiled = build("lfm2")
    prompt = tokens(1, 20, seed=17)
    reference = generate(compiled, prompt)
    store = new_store(compiled)
    compiled.forward = torch.compile(compiled.forward, dynamic=True, backend="eager")
    generate(compiled, prompt, HybridPrefixCache(store))
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(compiled, prompt, cache), reference)
    assert cache.reused_tokens == 19


def test_beam_search_is_exact_and_admits_the_reordered_beams(model):
    store, prompt = new_store(model), tokens(1, 18, seed=18)
    warm(model, store, prompt)
    cache = HybridPrefixCache(store)
    out = generate(model, prompt, cache, num_beams=3, num_return_sequences=2, max_new_tokens=5)
    assert torch.equal(out, generate(model, prompt, num_beams=3, num_return_sequences=2, max_new_tokens=5))
    assert cache.reused_tokens == 17
    # every row was admitted with the tokens its tensors hold after the beams were reordered: a follow-up on a
    # row's tokens resumes from that row's state and stays exact
    held = cache.held_tokens()
    assert held.shape == (3, 22)
    for seed, row in enumerate(held, start=19):
        follow_up = torch.cat([row[None], tokens(1, 3, seed=seed)], dim=1)
        cache = HybridPrefixCache(store)
        assert torch.equal(generate(model, follow_up, cache), generate(model, follow_up))
        assert cache.reused_tokens == 22
    store.core.check_invariants()


@settings(max_examples=8, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 30), min_size=3, max_size=3),
    tails=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    capacity_kib=st.sampled_from([64, 256, 16384]),
    policy=st.sampled_from(["dp", "marconi", "vllm+"]),
)
def test_any_request_sequence_is_exact_under_any_budget(model, cuts, tails, capacity_kib, policy):
    """Requests sharing prefixes of one base sequence, under budgets from tight (evicting) to roomy: outputs always
    equal the reference and the store stays consistent."""
    base = tokens(1, 30, seed=20)
    store = new_store(model, capacity=capacity_kib * 1024, policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tight budgets may refuse an entry: it runs uncached
        for i, (cut, tail) in enumerate(zip(cuts, tails, strict=True)):
            prompt = torch.cat([base[:, :cut], tokens(1, tail, seed=21 + i)], dim=1)
            cache = HybridPrefixCache(store)
            reference = generate(model, prompt, max_new_tokens=3)
            assert torch.equal(generate(model, prompt, cache, max_new_tokens=3), reference)
            assert cache.reused_tokens < prompt.shape[1]
            store.flush()
            store.core.check_invariants()
    store.close()


@pytest.mark.parametrize("offload", [None, "64MB"])
def test_a_conversation_that_fills_the_store_keeps_reusing_its_last_turn(model, offload):
    """Each turn's path is locked while it is admitted: once the store was full every later turn was refused for
    capacity and reused the same early turn for good; the path's shallower states now make room for the new one's
    (moved to the host tier if there is one)."""
    store = new_store(model, capacity=300_000, policy="dp", offload_capacity=offload)
    seq = first = tokens(1, 20, seed=3)
    for turn in range(7):
        cache = HybridPrefixCache(store)
        out = model.generate(seq, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(out, model.generate(seq, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert cache.reused_tokens == (seq.shape[1] - 41 if turn else 0), f"turn {turn}"  # (up to the last fed token)
        assert store.stats()["used_bytes"] <= 300_000
        seq = torch.cat([out, tokens(1, 40, seed=10 + turn)], 1)
    assert store.stats()["rejected"] == 0
    if offload:  # the first turn's thinned states: a prompt leaving the conversation there resumes from the host
        cache, edited = HybridPrefixCache(store), torch.cat([first, tokens(1, 6, seed=99)], 1)
        out = model.generate(edited, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(out, model.generate(edited, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert cache.reused_tokens > 0 and cache.report().rows[0].from_host
