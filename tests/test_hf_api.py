"""The card's form: `prefixlab.patch(model)` once, then `HybridPrefixCache(policy="dp")` without a store, in generate
and in direct forwards; the default store's options; the error that names the missing line."""

import pytest
import recurrent_patch_models
import torch
from hf_models import build, cache_argument, generate, tokens

import prefixlab
from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.hooks import is_attached
from prefixlab.errors import InvalidInputError


def test_the_cards_line_reuses_exactly_in_generate_and_direct_forwards():
    model = prefixlab.patch(build("qwen3_5"))
    prompt = tokens(1, 24, seed=1)
    reference = generate(model, prompt)
    first = HybridPrefixCache(policy="dp", capacity="64MB")
    assert torch.equal(generate(model, prompt, first), reference)
    second = HybridPrefixCache(policy="dp")  # same default store: options left out or equal share it
    assert torch.equal(generate(model, prompt, second), reference)
    assert first.store is second.store and second.reused_tokens == 23
    assert second.store.capacity_bytes == 64 * 10**6
    # a direct forward: the outputs cover the tokens after the reused prefix
    cache = HybridPrefixCache()
    logits = model(input_ids=prompt, past_key_values=cache).logits
    assert cache.reused_tokens == 23
    torch.testing.assert_close(logits, model(input_ids=prompt).logits[:, 23:], atol=1e-5, rtol=0)
    prefixlab.unpatch(model)
    assert not is_attached(model) and not getattr(model, "prefixlab_patched", False)
    assert first.store.closed


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "mamba2"])
def test_without_setup_the_error_names_the_line_to_add(family):
    model = build(family)
    with pytest.raises(InvalidInputError, match=r"prefixlab\.patch\(model\)"):
        generate(model, tokens(1, 8), HybridPrefixCache(policy="dp"))


def test_options_must_match_the_default_store_and_the_first_store_is_the_default():
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="32MB", policy="marconi", block_size=4)
    prompt = tokens(1, 12, seed=2)
    generate(model, prompt, HybridPrefixCache(store))
    cache = HybridPrefixCache(policy="marconi")  # no patch() needed: the store's hooks are on the model
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt))
    assert cache.store is store and cache.reused_tokens == 11
    before = store.stats()
    with pytest.raises(InvalidInputError, match="default store was built with.*'policy': 'marconi'"):
        generate(model, prompt, HybridPrefixCache(policy="dp"))
    assert store.stats() == before  # refused before anything ran
    store.close()
    with pytest.raises(InvalidInputError, match=r"prefixlab\.patch\(model\)"):
        generate(model, prompt, HybridPrefixCache())


def test_bad_cache_options_are_refused_at_construction():
    store = PrefixStore(build("qwen3_5"), capacity="16MB")
    with pytest.raises(InvalidInputError, match="options of the store"):
        HybridPrefixCache(store, policy="dp")
    with pytest.raises(InvalidInputError, match="unknown HybridPrefixCache options"):
        HybridPrefixCache(capacty="1GB")
    with pytest.raises(InvalidInputError, match="capacity"):
        HybridPrefixCache(capacity="lots")
    with pytest.raises(InvalidInputError, match="policy"):
        HybridPrefixCache(policy="lru")
    store.close()


@pytest.mark.parametrize("model", [None, "Qwen/Qwen3.5-0.8B"])
def test_a_default_store_for_what_is_not_a_model_is_refused_clearly(model):
    """HybridPrefixCache.for_model(None) (a model variable not loaded yet, or a checkpoint name) raised AttributeError
    "'NoneType' object has no attribute '__dict__'"."""
    with pytest.raises(InvalidInputError, match="model must be a transformers model, got"):
        HybridPrefixCache.for_model(model)
    with pytest.raises(InvalidInputError, match="model must be a transformers model, got"):
        PrefixStore.default_for(model)
    with pytest.raises(InvalidInputError, match=r"prefixlab.unpatch\(model\) needs a transformers model, got"):
        prefixlab.unpatch(model)


@pytest.mark.parametrize("patch", ["no", "False", None, 0.0])
def test_a_patch_option_that_is_not_a_bool_is_refused(patch):
    """patch="False" (an option read from a file or the environment) built a patched store, None an unpatched one."""
    model = build("qwen3_5")
    with pytest.raises(InvalidInputError, match=r"patch=.* must be True or False"):
        PrefixStore(model, patch=patch)
    with pytest.raises(InvalidInputError, match=r"patch=.* must be True or False"):
        HybridPrefixCache(patch=patch)
    with pytest.raises(InvalidInputError, match=r"kernels=.* must be True or False"):
        prefixlab.patch(model, kernels=patch)
    assert not is_attached(model) and not getattr(model, "prefixlab_patched", False)


@pytest.mark.parametrize("family", ["mamba2", "jamba", "falcon_mamba", "llama"])
def test_the_cards_line_on_other_families(family):
    """cache_params= (Mamba2), Mamba1 served only patched (Jamba; Falcon-Mamba, with cache_params=), a KV-only
    model."""
    model = build(family)
    prompt = tokens(1, 16, seed=3)
    reference = generate(model, prompt)
    prefixlab.patch(model)
    generate(model, prompt, HybridPrefixCache(policy="dp"))
    cache = HybridPrefixCache(policy="dp")
    assert torch.equal(generate(model, prompt, cache), reference)
    assert cache.report().reasons == ["hit"] and cache.reused_tokens == 15
    prefixlab.unpatch(model)


def test_a_model_and_its_default_store_are_garbage_collected():
    import gc
    import weakref

    model = prefixlab.patch(build("qwen3_5"))
    generate(model, tokens(1, 8), HybridPrefixCache(capacity="8MB"))
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None


def test_assisted_decoding_on_an_attention_only_model_is_exact_and_crops_the_record():
    """Prompt lookup decoding (transformers' assisted generation) verifies candidates in one forward that wants
    their logits (logits_to_keep = candidates + 1) and crops the rejected ones: the cache leaves those tokens to
    compute, crops KV and token record alike, and a later request reuses what was admitted."""
    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 30, seed=4)
    prompt = torch.cat([prompt, prompt[:, :10]], dim=1)  # repeats: the lookup proposes candidates
    options = dict(prompt_lookup_num_tokens=3, max_new_tokens=8)
    for _ in range(2):  # the second one's prompt and first candidates are all in the store
        cache = HybridPrefixCache(store)
        assert torch.equal(generate(model, prompt, cache, **options), generate(model, prompt, **options))
        assert cache.get_seq_length() == cache.held_tokens().shape[1] == cache.layers[0].keys.shape[-2]
        store.core.check_invariants()
    assert cache.reused_tokens > 0 and store.stats()["locked_matches"] == 0
    with pytest.raises(InvalidInputError, match="negative"):
        cache.crop(2)


def test_a_forward_gets_every_logit_it_asks_for_and_hybrids_refuse_to_crop():
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 20, seed=6)
    with torch.no_grad():
        generate(model, prompt, HybridPrefixCache(store))
        cache = HybridPrefixCache(store)
        got = model(input_ids=prompt, past_key_values=cache, logits_to_keep=5).logits
        picked = model(input_ids=prompt, past_key_values=HybridPrefixCache(store),
                       logits_to_keep=torch.tensor([2, 7])).logits  # indices name columns of the whole input
        expected = model(input_ids=prompt).logits
    assert 0 < cache.reused_tokens <= 15 and not cache.is_croppable
    torch.testing.assert_close(got, expected[:, -5:], atol=1e-5, rtol=0)
    torch.testing.assert_close(picked, expected[:, [2, 7]], atol=1e-5, rtol=0)
    cache.crop(0)  # transformers' no-op rollback
    with pytest.raises(InvalidInputError, match="recurrent states cannot roll back"):
        cache.crop(-1)


@pytest.mark.parametrize("family", ["mamba2", "mamba", "qwen3_5_text"])
def test_reset_admits_what_the_cache_holds_and_serves_a_new_request(family):
    """transformers' reset() empties a cache in place. Before the store admitted the request that cache held, that
    put zero states into the store (pure Mamba2) or crashed the next request of any cache (hybrids). Now reset
    admits first, and the same object then serves a new prompt as a new cache would."""
    model = recurrent_patch_models.build(family, seed=3)  # unit-scale weights: a zero state shows in the logits
    store = PrefixStore(model, capacity="64MB")
    prompt, other = tokens(1, 24, seed=8) % 57 + 3, tokens(1, 20, seed=9) % 57 + 3
    cache = HybridPrefixCache(store)
    first = generate(model, prompt, cache)
    cache.reset()
    turn = torch.cat([first, tokens(1, 5, seed=10) % 57 + 3], dim=1)  # resumes where the reset cache's request ended
    with torch.no_grad():
        cached = HybridPrefixCache(store)
        got = model(input_ids=turn, **{cache_argument(model): cached}).logits
        expected = model(input_ids=turn).logits
    assert cached.reused_tokens == first.shape[1] - 1
    torch.testing.assert_close(got, expected[:, cached.reused_tokens:], atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 0
    assert torch.equal(generate(model, other, cache), generate(model, other))  # the same object, a new request
    store.core.check_invariants()


@pytest.mark.parametrize("patch", [True, False])
def test_a_forward_with_grad_enabled_leaves_no_autograd_graph_in_the_store(patch):
    """A direct forward outside no_grad (a common slip) must not make the store keep the request's graph alive."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB", patch=patch)
    model(input_ids=tokens(1, 24, seed=11), past_key_values=HybridPrefixCache(store))
    store.flush()
    stored = [t for node in store.core.tree.nodes() if node.kv is not None
              for t in (*node.kv.keys.values(), *node.kv.values.values())]
    stored += [t for node in store.core.tree.nodes() for state in node.ckpt_state
               for t in (*state.conv.values(), *state.recurrent.values())]
    assert len(stored) > 4 and not any(t.requires_grad or t.grad_fn is not None for t in stored)


def test_a_model_converted_after_its_store_was_built_is_refused_with_what_to_do():
    from prefixlab.attention import hydragen_cache_from_store
    from prefixlab.errors import ModelMismatchError

    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 16, seed=13)
    generate(model, prompt, HybridPrefixCache(store))
    before = store.stats()
    model.to(torch.bfloat16)  # before: a dtype error inside attention on the next reuse
    with pytest.raises(ModelMismatchError, match=r"converted to torch.bfloat16 .*store\.close"):
        generate(model, prompt, HybridPrefixCache(store))
    with pytest.raises(ModelMismatchError, match="converted"):
        hydragen_cache_from_store(store, prompt, 1)
    assert store.stats() == before
    store.close()
    fresh = PrefixStore(model, capacity="64MB")
    generate(model, prompt, HybridPrefixCache(fresh))
    cache = HybridPrefixCache(fresh)
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt)) and cache.reused_tokens == 15


def test_copying_a_cache_is_refused_with_the_stores_way_to_reuse_a_prefix():
    import copy

    model = build("llama")
    cache = HybridPrefixCache(PrefixStore(model, capacity="64MB"))
    model(input_ids=tokens(1, 12, seed=14), past_key_values=cache)
    for duplicate in (copy.deepcopy, copy.copy):
        with pytest.raises(InvalidInputError, match=r"new HybridPrefixCache\(store\)"):
            duplicate(cache)


@pytest.mark.parametrize(("family", "patch"), [("llama", True), ("qwen3_5_text", True), ("qwen3_5_text", False)])
def test_chunked_prefill_resumes_past_its_first_chunk(family, patch):
    """generate(prefill_chunk_size=...) shows the cache its prompt one chunk at a time: each chunk's forward resumes
    from the deepest checkpoint of the tokens so far (before: at most the first chunk), in padded batches too, and
    the store counts each request once with what it finally reused. With transformers' layers (patch=False) a chunk
    is split where a state is planned inside it, as a first forward is."""
    from transformers import DynamicCache

    model = build(family) if family == "llama" else recurrent_patch_models.build(family, seed=3)
    store = PrefixStore(model, capacity="64MB", patch=patch)
    system = tokens(1, 30, seed=15) % 57 + 3
    reused = []
    for k in range(4):
        prompt = torch.cat([system, tokens(1, 4 + k, seed=16 + k) % 57 + 3], dim=1)
        cache = HybridPrefixCache(store)
        got = generate(model, prompt, cache, prefill_chunk_size=8)
        assert torch.equal(got, generate(model, prompt, DynamicCache(config=model.config), prefill_chunk_size=8))
        report = cache.report()
        assert report.rows[0].reused == cache.reused_tokens
        assert report.admitted_tokens == got.shape[1] - 1 - (30 if k else 0)  # mid-request admissions kept
        reused.append(cache.reused_tokens)
    assert reused[0] == 0 and reused[-1] == 30  # the branch point, in the fourth chunk
    for lengths in ((5, 5), (3, 9)):  # a batch: both rows at the branch point; rows resuming at one padded column
        rows = [torch.cat([system, tokens(1, n, seed=20 + n + i) % 57 + 3], dim=1)[0] for i, n in enumerate(lengths)]
        width = max(map(len, rows))
        ids = torch.zeros(2, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        cache = HybridPrefixCache(store)
        got = generate(model, ids, cache, attention_mask=mask, prefill_chunk_size=8)
        assert torch.equal(got, generate(model, ids, DynamicCache(config=model.config), attention_mask=mask,
                                         prefill_chunk_size=8))
        pads = [width - len(row) for row in rows]
        # one padded column (a row prefilled alone up to it first reports what the store held: align.py)
        assert cache.primed or cache.rows_reused[0] + pads[0] == cache.rows_reused[1] + pads[1]
        reused += cache.rows_reused
    assert reused[4:6] == [30, 30]  # past the first chunk
    stats = store.stats()
    assert stats["sequences"] == 8 and stats["reused_tokens"] == sum(reused)
    store.core.check_invariants()


@pytest.mark.parametrize("policy", ["marconi", "dp"])
def test_chunked_prefill_stores_what_one_prefill_would_not_a_state_per_chunk(policy):
    """The chunks' own lookups must not admit the request at every chunk's end (each would store a state there), and
    what dp placed over a shorter part of the prompt is dropped where the next chunk's plan moves it."""
    model = recurrent_patch_models.build("qwen3_5_text", seed=3)
    counts = []
    for chunk in (None, 8):
        store = PrefixStore(model, capacity="256MB", policy=policy)
        system = tokens(1, 100, seed=30) % 57 + 3
        for k in range(3):
            generate(model, torch.cat([system, tokens(1, 5 + k, seed=31 + k) % 57 + 3], dim=1),
                     HybridPrefixCache(store), prefill_chunk_size=chunk)
        counts.append(store.stats()["checkpoints"])
        store.close()
    assert counts[1] <= counts[0]


@pytest.mark.parametrize("chunk", [3, 5])
def test_a_chunked_prompt_is_reused_whole_by_its_repeat(chunk):
    """Patched layers record, within the pass, the state where an identical prompt would resume. Before: only at the
    first chunk's end, so a repeat of a chunked 28-token prompt reused 12 (chunks of 5) or 2 (of 3) where an unchunked
    one reuses 27; now at the last chunk's end (an earlier chunk's end is dropped with the chunk after it)."""
    model = build("qwen3_5")
    prompt = torch.arange(5, 33)[None]
    other = prompt.clone()
    other[0, 12] = 99  # another prompt branching off it at 12
    store = PrefixStore(model, capacity="64MB")
    reused = []
    for ids in (prompt, other, prompt):
        cache = HybridPrefixCache(store)
        got = generate(model, ids, cache, prefill_chunk_size=chunk)
        assert torch.equal(got, generate(model, ids, prefill_chunk_size=chunk))
        reused.append(cache.reused_tokens)
    assert reused[2] >= prompt.shape[1] - 2
    store.close()


def test_a_served_model_refuses_a_deep_copy_and_copies_once_its_store_is_closed():
    """Before: copy.deepcopy(model) with a store open failed with "cannot pickle '_thread.lock' object" (and a copy
    would have run its forward through this model's hooks and forward). Now a clear error says what to do; once the
    store is closed the copy is a plain, independent model."""
    import copy

    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    with pytest.raises(InvalidInputError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    store.close()
    twin = copy.deepcopy(model)
    assert "forward" not in vars(twin)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
        ids = torch.tensor([[5, 6, 7]])
        assert not torch.equal(twin(ids).logits, model(ids).logits)


def test_a_compiled_model_reuses_exactly():
    """`model.compile()` compiles the module call, forward hooks included: dynamo traced the cache's bookkeeping and
    failed on its data-dependent lookups (DynamicOutputShapeException). The hooks run eagerly now."""
    model = build("qwen3_5")
    prefix = torch.randint(3, 120, (30,), generator=torch.Generator().manual_seed(2))
    prompts = [torch.cat([prefix, torch.tensor([5 + k, 9, 11 + k])])[None] for k in range(3)]
    expected = [model.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0) for p in prompts]

    def serve() -> list[int]:
        store, reused = PrefixStore(model, capacity="64MB"), []
        for prompt, reference in zip(prompts, expected, strict=True):
            cache = HybridPrefixCache(store)
            assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                              past_key_values=cache), reference)
            reused.append(cache.reused_tokens)
        store.close()
        return reused

    eager = serve()
    model.compile()
    assert serve() == eager and min(eager[1:]) > 0


@pytest.mark.parametrize("family", ["mamba2", "mamba", "qwen3_5_text"])
def test_generate_never_auto_compiles_the_forward_over_the_cache(family, monkeypatch):
    """On CUDA, generate() compiles the forward over a cache whose layers are all compileable (only linear layers,
    e.g. Mamba2): seen on an H200, inductor traced the store's hooks. DynamicCache, which the cache replaces, is
    exempt by its type; the cache opts out."""
    model = recurrent_patch_models.build(family)
    store = PrefixStore(model, capacity="64MB")
    cache = HybridPrefixCache(store)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))  # CUDA's decision
    assert not model._valid_auto_compile_criteria({cache_argument(model): cache}, model.generation_config)
    store.close()
