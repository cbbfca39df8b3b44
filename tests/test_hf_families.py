"""Exactness of HybridPrefixCache on every family: generate() with reuse == generate() without prefixlab.

Each family serves three questions over one system prompt and a follow-up chat turn. The reference is the same model
without any cache object of ours: greedy tokens identical, fp32 logits of every step within 1e-5.
"""

import sys

import pytest
import torch
from hf_models import FAMILIES, build, cache_argument, config, reference_cache

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.hooks import forward_parameters
from prefixlab.cache.store import STATE_DROPPING_MODEL_TYPES, PrefixStore
from prefixlab.errors import InvalidInputError, UnsupportedModelError
from prefixlab.recurrent.families import SUPPORTED_CLASSES
from prefixlab.recurrent.patch import patch

TOLERANCE = 1e-5


def family_param(family: str):
    """The family, expected to fail with UnsupportedModelError while the cost model has no reader for it (strict:
    the test fails once the reader lands, so this mark gets removed)."""
    try:
        ModelSpec.from_config(config(family))
        return family
    except UnsupportedModelError:
        pass
    reason = "prefixlab.cache.hfspec has no cost-model reader for this model type yet"
    return pytest.param(family, marks=pytest.mark.xfail(raises=UnsupportedModelError, strict=True, reason=reason))


SERVED = [family_param(f) for f in FAMILIES if f not in STATE_DROPPING_MODEL_TYPES]


def generate(model, input_ids, cache=None, max_new_tokens=6):
    kwargs = {cache_argument(model): cache} if cache is not None else {}
    return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, **kwargs)


def assert_same(reference, served):
    assert torch.equal(reference.sequences, served.sequences)
    for ref_step, step in zip(reference.logits, served.logits, strict=True):
        torch.testing.assert_close(step, ref_step, rtol=0, atol=TOLERANCE)


def serve_workload(model, store):
    """Three questions over a system prompt, then a second chat turn; returns the reuse of each request and what
    the turn can reuse: all the previous turn fed (prompt + output[:-1]; its last sampled token is run), or, where
    decode steps may compute differently from prefills (model_info.decode_differs_from_prefill), only its prompt
    if they did (Nemotron-H at this init scale; test_recurrent_patch_store.py pins both cases down)."""
    rng = torch.Generator().manual_seed(7)
    system = torch.randint(3, 128, (1, 24), generator=rng)
    reused = []
    for _ in range(3):
        prompt = torch.cat([system, torch.randint(3, 128, (1, 5), generator=rng)], dim=1)
        cache = HybridPrefixCache(store)
        served = generate(model, prompt, cache)
        assert_same(generate(model, prompt), served)
        reused.append(cache.reused_tokens)
    follow_up = torch.cat([served.sequences, torch.randint(3, 128, (1, 4), generator=rng)], dim=1)
    cache = HybridPrefixCache(store)
    assert_same(generate(model, follow_up), generate(model, follow_up, cache))
    reused.append(cache.reused_tokens)
    full = served.sequences.shape[1] - 1
    return reused, reused[3] if store.decode_differs and reused[3] in (prompt.shape[1], full) else full


@pytest.mark.parametrize("family", SERVED)
def test_reuse_is_exact(family):
    """transformers' own layers (patch=False): planned states are captured by splitting the prefill."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=False)
    assert not store.records_in_kernel
    reused, turn_reusable = serve_workload(model, store)
    assert reused[0] == 0
    assert reused[2] >= 24, "the third question reuses the system prompt"
    assert reused[3] == turn_reusable
    store.core.check_invariants()


def has_patchable_layers(family: str) -> bool:
    module = sys.modules[FAMILIES[family][1].__module__]
    return any(hasattr(module, name) for name in SUPPORTED_CLASSES)


@pytest.mark.parametrize("family", [family_param(f) for f in FAMILIES if has_patchable_layers(f)])
def test_reuse_is_exact_with_patched_recurrent_layers(family):
    """Patched layers record the planned states inside one forward instead of the hook splitting the prefill."""
    model = patch(build(family))
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    assert store.records_in_kernel
    reused, turn_reusable = serve_workload(model, store)
    assert reused[2] >= 24 and reused[3] == turn_reusable


@pytest.mark.parametrize("family", [family_param(f) for f in FAMILIES if has_patchable_layers(f)])
def test_rows_of_one_cached_prompt_primed_in_one_right_padded_forward_are_exact(family):
    """A left-padded batch of three rows under one cached 24-token prompt (questions of 7, 8, 9 tokens): their
    primes run as one right-padded forward, each row's states captured at its own end by the patched layers
    (align.py), and the batch then matches the uncached batched generate (tokens, fp32 logits) reusing the prompt."""
    from test_hf_cache_padding import left_pad

    model = patch(build(family))
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)

    def run(input_ids, cache=None, **options):
        served = {cache_argument(model): cache} if cache is not None else {}
        return model.generate(input_ids, do_sample=False, pad_token_id=0, max_new_tokens=4, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True, **served, **options)

    rng = torch.Generator().manual_seed(7)
    system = torch.randint(3, 128, (24,), generator=rng)
    for _ in range(2):  # a branch point at 24
        run(torch.cat([system, torch.randint(3, 128, (3,), generator=rng)])[None], HybridPrefixCache(store))
    batch, mask = left_pad([torch.cat([system, torch.randint(3, 128, (n,), generator=rng)]) for n in (7, 8, 9)])
    shapes = []
    counter = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                              with_kwargs=True)
    cache = HybridPrefixCache(store)
    try:
        got = run(batch, cache, attention_mask=mask)
    finally:
        counter.remove()
    expected = run(batch, reference_cache(model), attention_mask=mask)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert cache.rows_reused == [24, 24, 24]
    # one prime for the three rows (to column 32, or 31 where decode steps may differ: 2 tokens left), then the batch
    assert shapes[0] in ((3, 8), (3, 7)) and shapes[1] == (3, 33 - 24 - shapes[0][1])


@pytest.mark.parametrize("family", sorted(STATE_DROPPING_MODEL_TYPES))
def test_families_that_cannot_resume_unpatched_are_refused(family):
    model = build(family)
    with pytest.raises(UnsupportedModelError, match="recurrent.patch"):
        PrefixStore(model, patch=False)
    assert not getattr(model, "prefixlab_patched", False)


@pytest.mark.parametrize("family", ["qwen3_5", "jamba"])
def test_store_patches_by_default_and_close_restores_the_model(family):
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    assert store.records_in_kernel
    reused, _ = serve_workload(model, store)
    assert reused[2] >= 24
    store.close()
    assert not getattr(model, "prefixlab_patched", False)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "gemma"])
def test_kv_only_models_reuse_every_shared_token(family):
    """Attention-only models need no checkpoints: any shared prefix is reusable."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    reused, turn_reusable = serve_workload(model, store)
    assert reused[1] >= 24  # the second question already reuses the whole system prompt
    assert reused[3] == turn_reusable
    store.core.check_invariants()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_table_names_the_layers_patch_serves(family):
    """hfspec.MODEL_FAMILIES (the one table a new family is added to) says which recurrent layer family patches the
    model type: that is what prefixlab.recurrent.patch finds in a tiny model of it (none for KV-only models)."""
    from prefixlab.cache.hfspec import MODEL_FAMILIES
    from prefixlab.recurrent.patch import linear_attention_layers

    model = build(family)
    expected = MODEL_FAMILIES[model.config.model_type.removesuffix("_text")].layer_family
    found = {type(layer_family).__name__ for _, layer_family in linear_attention_layers(model)}
    assert found == ({expected} if expected else set())


@pytest.mark.parametrize(("family", "patched"), [("bamba", True), ("bamba", False), ("qwen3_5", False),
                                                 ("nemotron_h", True), ("llama", True)])
def test_direct_forwards_without_position_ids_run_at_the_sequences_positions(family, patched):
    """model(input_ids=..., past_key_values=HybridPrefixCache(store)) without position_ids, as a prefix hit, split
    prefill (patch=False) and continuation calls: each call's logits are those of one uncached forward over the
    whole sequence at the same positions (Bamba counts positions from 0 on every call unless told otherwise)."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="sglang+", block_size=4, patch=patched)
    rng = torch.Generator().manual_seed(3)
    system = torch.randint(3, 128, (1, 16), generator=rng)
    first, second = (torch.cat([system, torch.randint(3, 128, (1, 6), generator=rng)], dim=1) for _ in range(2))
    more = torch.randint(3, 128, (1, 3), generator=rng)
    with torch.no_grad():
        for prompt in (first, second, first):
            model(input_ids=prompt, past_key_values=HybridPrefixCache(store))
        cache = HybridPrefixCache(store)
        whole = torch.cat([second, more], dim=1)
        expected = model(input_ids=whole).logits
        got = model(input_ids=second, past_key_values=cache).logits
        assert cache.reused_tokens >= 16
        torch.testing.assert_close(got, expected[:, cache.reused_tokens:second.shape[1]], rtol=0, atol=TOLERANCE)
        for column in range(second.shape[1], whole.shape[1]):  # continuation calls, one token each
            got = model(input_ids=whole[:, column:column + 1], past_key_values=cache).logits
            torch.testing.assert_close(got[:, -1], expected[:, column], rtol=0, atol=TOLERANCE)


def split_prefill_case(family: str, policy: str):
    """A patch=False store holding a first request, and a second request sharing its 16 first tokens: its prefill
    splits at the branch point there to capture the state (model, store, first, second)."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy=policy, block_size=4, patch=False)
    rng = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (1, 16), generator=rng)
    first, second = (torch.cat([system, torch.randint(3, 128, (1, 6), generator=rng)], dim=1) for _ in range(2))
    return model, store, first, second


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_split_direct_forward_returns_the_logits_of_every_token_it_ran(family):
    """patch=False captures a planned state by splitting the prefill; a direct forward still returns logits for every
    token after the reused prefix (not only the last segment's), equal to one uncached forward's."""
    model, store, first, second = split_prefill_case(family, "sglang+")
    with torch.no_grad():
        model(input_ids=first, past_key_values=HybridPrefixCache(store))
        cache = HybridPrefixCache(store)
        got = model(input_ids=second, past_key_values=cache).logits  # the branch point at 16 splits this prefill
        expected = model(input_ids=second).logits
    assert got.shape[1] == second.shape[1] - cache.reused_tokens
    torch.testing.assert_close(got, expected[:, cache.reused_tokens:], rtol=0, atol=TOLERANCE)
    with torch.no_grad():
        kept = model(input_ids=second[:, :20], past_key_values=HybridPrefixCache(store), logits_to_keep=3).logits
    torch.testing.assert_close(kept, expected[:, 17:20], rtol=0, atol=TOLERANCE)


def test_a_split_direct_forward_keeps_the_logits_a_tensor_of_indices_names():
    """logits_to_keep as a tensor of column indices (transformers allows it) on a patch=False prefill split at a
    planned capture: before, InvalidInputError after the request was looked up and counted in stats()."""
    model, store, first, second = split_prefill_case("qwen3_5", "marconi")
    keep = torch.tensor([0, 3, 21])
    with torch.no_grad():
        model(input_ids=first, past_key_values=HybridPrefixCache(store))
        got = model(input_ids=second, past_key_values=HybridPrefixCache(store), logits_to_keep=keep).logits  # split
        expected = model(input_ids=second, logits_to_keep=keep).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)


def test_a_split_direct_forward_returns_a_tuple_when_asked():
    """return_dict=False on a patch=False prefill split at a planned capture: before, AttributeError ('tuple' object
    has no attribute 'logits') from the hooks; now the tuple's logits cover every token run, as return_dict=True's."""
    model, store, first, second = split_prefill_case("qwen3_5", "marconi")
    with torch.no_grad():
        model(input_ids=first, past_key_values=HybridPrefixCache(store))
        got = model(input_ids=second, past_key_values=HybridPrefixCache(store), return_dict=False)  # split at 16
        expected = model(input_ids=second).logits
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=TOLERANCE)


def test_a_forward_asking_for_hidden_states_returns_them_for_every_token_it_ran():
    """patch=False splits a prefill at a planned capture; before, output_hidden_states (direct, and generate's first
    step) held the last segment's tokens only (6 of a 22-token miss) while the logits covered all 22. A forward that
    asks for per-layer outputs now runs whole (that capture is skipped): they match one uncached forward's."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=False)
    rng = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (1, 16), generator=rng)
    first, second, third = (torch.cat([system, torch.randint(3, 128, (1, 6), generator=rng)], dim=1)
                            for _ in range(3))
    with torch.no_grad():
        model(input_ids=first, past_key_values=HybridPrefixCache(store))
        got = model(input_ids=second, past_key_values=HybridPrefixCache(store), output_hidden_states=True)
        expected = model(input_ids=second, output_hidden_states=True)
        cache = HybridPrefixCache(store)
        served = model.generate(third, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                output_hidden_states=True, return_dict_in_generate=True)
    assert len(got.hidden_states) == len(expected.hidden_states)
    for mine, theirs in zip(got.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=TOLERANCE)
    assert all(state.shape[1] == third.shape[1] - cache.reused_tokens for state in served.hidden_states[0])


def test_labels_with_a_prefix_cache_are_refused_before_anything_runs():
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(InvalidInputError, match="labels"):
        model(input_ids=prompt, labels=prompt, past_key_values=HybridPrefixCache(store))
    assert store.stats()["requests"] == 0 and store.stats()["used_bytes"] == 0


@pytest.mark.parametrize("family", SERVED)
def test_one_cache_serves_one_request_and_the_calls_that_continue_it(family):
    """A later generate() over the same cache continues what it holds (a chat turn: exact, and the tokens it
    records are the sequence's, where Mamba2's generate feeds the whole sequence again); a new prompt over it is
    refused where the model takes positions (it ran on the old states: wrong tokens on Falcon-H1), and the cache
    then serves a new request."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    rng = torch.Generator().manual_seed(3)
    cache = HybridPrefixCache(store)
    first = generate(model, torch.randint(3, 128, (1, 20), generator=rng), cache)
    follow_up = torch.cat([first.sequences, torch.randint(3, 128, (1, 4), generator=rng)], dim=1)
    served = generate(model, follow_up, cache)
    assert_same(generate(model, follow_up), served)
    assert torch.equal(cache.held_tokens(), served.sequences[:, :-1])
    if "position_ids" in forward_parameters(model):
        other = torch.randint(3, 128, (1, 12), generator=rng)
        with pytest.raises(InvalidInputError, match="per request"):
            generate(model, other, cache)
        assert_same(generate(model, other), generate(model, other, cache))
    store.core.check_invariants()


@pytest.mark.parametrize(("family", "chunk"), [("llama", None), ("qwen3_5", None), ("qwen3_5", 8),
                                             ("falcon_h1", None)])
def test_a_longer_new_prompt_over_a_used_cache_is_refused(family, chunk):
    """generate() slices a prompt by the cache's length: a new prompt longer than what a used cache holds ran its
    tail at the positions that continue it, on the old request's KV and states (before: silently wrong tokens on
    every family; a shorter one was refused by its positions). Refused now, the old request admitted; the cache then
    serves the new prompt as a new request. (Mamba2's generate feeds a cache_params cache the whole input, new tokens
    to continue it by transformers' rules: not checked there.)"""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    rng = torch.Generator().manual_seed(4)
    first, other = torch.randint(3, 128, (1, 12), generator=rng), torch.randint(3, 128, (1, 30), generator=rng)
    cache = HybridPrefixCache(store)
    generate(model, first, cache)
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    with pytest.raises(InvalidInputError, match="per request"):
        model.generate(other, past_key_values=cache, **options)
    assert cache.get_seq_length() == 0 and store.stats()["sequences"] == 1  # reset, the first request admitted
    assert torch.equal(model.generate(other, past_key_values=cache, **options), model.generate(other, **options))
    store.core.check_invariants()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "mamba2"])
def test_another_batch_size_over_a_used_cache_is_refused(family):
    """A used cache passed to generate() with another number of rows cannot continue it. Before: a torch error
    (size mismatch in a cat, a reshape of 0 elements) or a ModelMismatchError blaming another model; now refused,
    the cache reset, and it then serves the batch as a new request."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    rng = torch.Generator().manual_seed(6)
    first = torch.randint(3, 128, (1, 12), generator=rng)
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    for width in (8, 15, 30):  # shorter than what the cache holds, as long, longer
        batch = torch.randint(3, 128, (2, width), generator=rng)
        cache = HybridPrefixCache(store)
        model.generate(first, **{cache_argument(model): cache}, **options)
        with pytest.raises(InvalidInputError, match="per request"):
            model.generate(batch, **{cache_argument(model): cache}, **options)
        assert cache.get_seq_length() == 0
        assert torch.equal(model.generate(batch, **{cache_argument(model): cache}, **options),
                           model.generate(batch, **options))
    store.core.check_invariants()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_new_tokens_that_repeat_what_the_cache_holds_are_not_taken_for_a_feed_again(family):
    model = build(family)
    store = PrefixStore(model, capacity="64MB")
    cache, (a, b) = HybridPrefixCache(store), (17, 42)
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([[a, a, b]])).logits
        model(input_ids=torch.tensor([[a]]), past_key_values=cache)
        out = model(input_ids=torch.tensor([[a, b]]), position_ids=torch.tensor([[1, 2]]), past_key_values=cache)
    torch.testing.assert_close(out.logits, full[:, 1:], rtol=0, atol=TOLERANCE)
