"""hydragen_cache_from_store: a prefix served by a PrefixStore becomes Hydragen's shared level (stored once), the
completions equal plain generation, the store is left as it was, a miss is plain Hydragen prefill, bad input."""

import pytest
import torch
from hf_models import VOCAB, build
from hydragen_helpers import assert_same as _assert_same
from hydragen_helpers import generate_seeded
from transformers import DynamicCache

from prefixlab.attention import hydragen_cache_from_store
from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import InvalidInputError, ModelMismatchError
from prefixlab.recurrent import patch

N, PREFIX, SUFFIX = 4, 20, 6
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "lfm2"])  # (LFM2: conv states only)
def pair(request):
    """(standard sdpa model, the same weights with attn_implementation="hydragen"), fp32, eval."""
    standard, hydragen = build(request.param), build(request.param)
    hydragen.set_attn_implementation("hydragen")
    return standard, hydragen


@pytest.fixture
def store(pair):
    store = PrefixStore(pair[1], capacity="64MB", block_size=8)
    yield store
    store.close()


def _tokens(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, seed, cache=None, **kwargs):
    return generate_seeded(model, ids, seed, cache, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW_TOKENS),
                           **kwargs)


def _kv_bytes(model, tokens: int) -> int:
    """fp32 K + V bytes of `tokens` tokens over every attention layer, for ONE sequence."""
    config = model.config
    layers = sum(kind == "full_attention" for kind in getattr(config, "layer_types", None)
                 or ["full_attention"] * config.num_hidden_layers)
    return layers * 2 * config.num_key_value_heads * config.head_dim * 4 * tokens


def _fill(store, prefix) -> None:
    """A first request through HybridPrefixCache: the store admits the prefix (a system prompt, say)."""
    _generate(store.model, prefix, 0, HybridPrefixCache(store), do_sample=False)
    store.flush()


def _snapshot(store) -> tuple:
    nodes = sorted((n.namespace, tuple(n.tokens.tolist()), tuple(n.ckpt_pos)) for n in store.core.tree.nodes()
                   if not n.is_root)
    stats = store.stats()
    return nodes, store.core.used_bytes, stats["sequences"], stats["reused_tokens"]


def _assert_untouched(store, before) -> None:
    store.core.check_invariants()
    assert store.stats()["locked_matches"] == 0
    assert _snapshot(store) == before


def _forward_widths(model):
    """Token counts of every forward `model` runs (hook removed by the caller)."""
    widths = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    return widths, handle


def test_greedy_completions_from_a_store_hit(pair, store):
    standard, hydragen = pair
    prefix = _tokens(1, PREFIX)
    _fill(store, prefix)
    before = _snapshot(store)
    prompt = torch.cat([prefix, _tokens(2, SUFFIX)], dim=1)
    cache = hydragen_cache_from_store(store, prompt, batch_size=N)
    reused = cache.get_seq_length()
    assert 0 < reused <= PREFIX
    assert cache.shared_bytes() == _kv_bytes(hydragen, reused) and cache.per_sequence_bytes() == 0  # once, not N
    widths, handle = _forward_widths(hydragen)
    try:
        out = _generate(hydragen, prompt.repeat(N, 1), 0, cache, do_sample=False)
    finally:
        handle.remove()
    _assert_same(_generate(standard, prompt.repeat(N, 1), 0, do_sample=False), out)
    assert widths == [prompt.shape[1] - reused] + [1] * (len(out.scores) - 1)  # only the uncached suffix
    _assert_untouched(store, before)


def test_sampled_completions_store_the_served_prefix_once(pair, store):
    standard, hydragen = pair
    prefix = _tokens(3, PREFIX)
    _fill(store, prefix)
    before = _snapshot(store)
    prompt = torch.cat([prefix, _tokens(4, SUFFIX)], dim=1)
    cache = hydragen_cache_from_store(store, prompt, batch_size=N)
    reused = cache.get_seq_length()
    assert reused > 0
    out = _generate(hydragen, prompt, 5, cache, do_sample=True, num_return_sequences=N)
    _assert_same(_generate(standard, prompt, 5, do_sample=True, num_return_sequences=N), out)
    # the served prefix and the prompt's identical N rows after it are one level; sampled tokens per sequence
    layer = next(layer for layer in cache.layers if hasattr(layer, "levels"))
    assert [level.length for level in layer.levels] == [prompt.shape[1]]
    assert cache.shared_bytes() == _kv_bytes(hydragen, prompt.shape[1])
    assert cache.per_sequence_bytes() == N * _kv_bytes(hydragen, MAX_NEW_TOKENS - 1)
    standard_cache = DynamicCache(config=standard.config)
    _generate(standard, prompt, 5, standard_cache, do_sample=True, num_return_sequences=N)
    standard_bytes = sum(t.numel() * 4 for layer in standard_cache.layers if getattr(layer, "keys", None) is not None
                         for t in (layer.keys, layer.values))
    assert standard_bytes == N * _kv_bytes(hydragen, prompt.shape[1] + MAX_NEW_TOKENS - 1)
    _assert_untouched(store, before)


def test_miss_is_plain_hydragen_prefill(pair, store):
    standard, hydragen = pair
    prompt = _tokens(6, PREFIX)
    _fill(store, prompt)
    before = _snapshot(store)
    cache = hydragen_cache_from_store(store, prompt, batch_size=N, namespace="another tenant")
    assert cache.get_seq_length() == 0 and cache.shared_bytes() == 0
    out = _generate(hydragen, prompt, 7, cache, do_sample=True, num_return_sequences=N)
    _assert_same(_generate(standard, prompt, 7, do_sample=True, num_return_sequences=N), out)
    assert cache.shared_bytes() == _kv_bytes(hydragen, PREFIX)  # Hydragen still shares the prompt it ran
    _assert_untouched(store, before)
    empty = PrefixStore(hydragen, capacity="1MB")
    try:
        assert hydragen_cache_from_store(empty, prompt, batch_size=2).get_seq_length() == 0
        assert empty.core.used_bytes == 0
    finally:
        empty.close()


def test_batch_size_is_checked_by_generate(pair, store):
    _, hydragen = pair
    prefix = _tokens(8, PREFIX)
    _fill(store, prefix)
    cache = hydragen_cache_from_store(store, torch.cat([prefix, _tokens(9, 3)], dim=1), batch_size=N)
    # the first layer to see the batch names the mismatch: the cache's attention layer, or a patched recurrent layer
    with pytest.raises(InvalidInputError, match=rf"batch_size={N}|initial_conv_state has shape \[{N},"):
        _generate(hydragen, torch.cat([prefix, _tokens(9, 3)], dim=1), 0, cache, do_sample=True,
                  num_return_sequences=N - 1)


def test_bad_input_raises_and_leaves_the_store_alone(pair, store):
    standard, hydragen = pair
    prompt = _tokens(10, PREFIX)
    _fill(store, prompt)
    before = _snapshot(store)
    for bad in (prompt.repeat(2, 1), prompt[0], prompt[:, :0], prompt.float(), prompt.tolist()):
        with pytest.raises(InvalidInputError, match="prompt_ids"):
            hydragen_cache_from_store(store, bad, batch_size=N)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidInputError, match="batch_size"):
            hydragen_cache_from_store(store, prompt, batch_size=bad)
    with pytest.raises(InvalidInputError, match="namespace"):
        hydragen_cache_from_store(store, prompt, batch_size=N, namespace="")
    with pytest.raises(InvalidInputError, match="PrefixStore"):
        hydragen_cache_from_store(hydragen, prompt, batch_size=N)
    other = build("qwen3" if hydragen.config.model_type == "llama" else "llama")
    other.set_attn_implementation("hydragen")
    with pytest.raises(ModelMismatchError, match="another model"):
        hydragen_cache_from_store(store, prompt, batch_size=N, model=other)
    with pytest.raises(InvalidInputError, match="set_attn_implementation"):
        hydragen_cache_from_store(store, prompt, batch_size=N, model=standard)  # same config, attention is sdpa
    _assert_untouched(store, before)


def test_prefix_served_from_the_host_tier(pair):
    standard, hydragen = pair
    first, second = _tokens(11, PREFIX), _tokens(12, PREFIX)
    # policy="marconi": the second fill must evict the first entry whole (dp would thin the prior states it placed
    # in the first entry, while nothing had been reused, and keep both entries on the device)
    sizing = PrefixStore(hydragen, capacity="64MB", block_size=8, policy="marconi")
    try:
        _fill(sizing, first)
        entry_bytes = sizing.core.used_bytes
    finally:
        sizing.close()
    store = PrefixStore(hydragen, capacity=entry_bytes * 3 // 2, offload_capacity="64MB", block_size=8,
                        policy="marconi")
    try:
        _fill(store, first)
        _fill(store, second)  # evicts the first prefix to the host tier
        before = _snapshot(store), store.offload.used_bytes
        prompt = torch.cat([first, _tokens(13, SUFFIX)], dim=1)
        cache = hydragen_cache_from_store(store, prompt, batch_size=N)
        assert cache.get_seq_length() > 0 and store.stats()["offload_hits"] == 1
        out = _generate(hydragen, prompt, 14, cache, do_sample=True, num_return_sequences=N)
        _assert_same(_generate(standard, prompt, 14, do_sample=True, num_return_sequences=N), out)
        store.offload.check_invariants()
        assert store.offload.stats()["locked_matches"] == 0
        _assert_untouched(store, before[0])
        assert store.offload.used_bytes == before[1]
    finally:
        store.close()


def test_patched_recurrent_layers_record_the_store_states():
    """With prefixlab.recurrent.patch the store records states inside the forward; they resume Hydragen exactly."""
    standard, hydragen = build("qwen3_5"), patch(build("qwen3_5"))
    hydragen.set_attn_implementation("hydragen")
    store = PrefixStore(hydragen, capacity="64MB", block_size=8)
    try:
        prefix = _tokens(15, PREFIX)
        _fill(store, prefix)
        prompt = torch.cat([prefix, _tokens(16, SUFFIX)], dim=1)
        cache = hydragen_cache_from_store(store, prompt, batch_size=N)
        assert cache.get_seq_length() > 0
        out = _generate(hydragen, prompt, 17, cache, do_sample=True, num_return_sequences=N)
        _assert_same(_generate(standard, prompt, 17, do_sample=True, num_return_sequences=N), out)
    finally:
        store.close()


def test_assisted_decoding_over_a_store_hit_is_refused_not_wrong():
    """Assisted decoding (prompt_lookup_num_tokens) feeds the WHOLE prompt to its first forward, whatever the cache
    holds: over the store's prefix loaded into a HydragenCache the model attended to it twice and generated other
    tokens than the plain model, silently. Now the forward is refused with what to do instead."""
    standard, hydragen = build("llama"), build("llama")
    hydragen.set_attn_implementation("hydragen")
    store = PrefixStore(hydragen, capacity="64MB", block_size=8)
    try:
        prompt = torch.tensor([[5, 6, 7, 8] * 4 + [5, 6, 7]])  # repeats: prompt lookup proposes candidates
        _fill(store, prompt)
        cache = hydragen_cache_from_store(store, prompt, batch_size=1)
        assert cache.get_seq_length() == prompt.shape[1] - 1
        with pytest.raises(InvalidInputError, match="Assisted decoding"):
            _generate(hydragen, prompt, 0, cache, do_sample=False, prompt_lookup_num_tokens=3)
        cache = hydragen_cache_from_store(store, prompt, batch_size=1)  # without assistance: exact
        _assert_same(_generate(standard, prompt, 0, do_sample=False), _generate(hydragen, prompt, 0, cache,
                                                                                  do_sample=False))
    finally:
        store.close()


def test_token_ids_outside_the_vocabulary_are_refused_before_the_lookup(pair, store):
    """An id past the embedding table was looked up (a hit on the ids before it) and handed to generate, which
    failed deep in torch (IndexError: index out of range in self)."""
    _, hydragen = pair
    prompt = _tokens(18, PREFIX)
    _fill(store, prompt)
    before = _snapshot(store)
    for bad in (VOCAB, VOCAB + 1000):
        ids = torch.cat([prompt, torch.tensor([[bad, 5]])], dim=1)
        with pytest.raises(InvalidInputError, match=rf"\[0, {PREFIX}\] = {bad} is not a token id"):
            hydragen_cache_from_store(store, ids, batch_size=N)
    _assert_untouched(store, before)


@pytest.mark.parametrize("family", ["falcon_h1", "zamba2", "zamba"])
def test_models_without_a_shareable_attention_layer_are_refused_as_such(family):
    """Falcon-H1, Zamba2 and Zamba keep attention KV in a cache layer shared with a recurrent one, which HydragenCache
    cannot share: the store built for the same model was refused as "another model" (ModelMismatchError)."""
    from prefixlab.errors import UnsupportedModelError

    model = build(family)
    model.set_attn_implementation("hydragen")
    store = PrefixStore(model, capacity="64MB", block_size=8)
    try:
        with pytest.raises(UnsupportedModelError, match="no attention layer HydragenCache can share"):
            hydragen_cache_from_store(store, _tokens(19, PREFIX), batch_size=N)
        assert store.stats()["locked_matches"] == 0
    finally:
        store.close()


def test_ids_an_embedding_cannot_take_and_a_model_with_active_dropout_are_refused_before_the_lookup(pair, store):
    """uint8 ids passed (generate then failed in torch's embedding); a model with dropout active was served (its
    outputs are random: HybridPrefixCache refuses it too)."""
    _, hydragen = pair
    prompt = _tokens(19, PREFIX)
    _fill(store, prompt)
    before = _snapshot(store)
    with pytest.raises(InvalidInputError, match=r"integer token ids \(int64 or int32\), got dtype torch.uint8"):
        hydragen_cache_from_store(store, prompt.to(torch.uint8), batch_size=N)
    attention = next((m for m in hydragen.modules() if hasattr(m, "attention_dropout")), None)
    if attention is None:  # (LFM2's attention has no dropout to switch on)
        return _assert_untouched(store, before)
    rate, attention.attention_dropout = attention.attention_dropout, 0.1
    hydragen.train()
    try:
        with pytest.raises(InvalidInputError, match="dropout active"):
            hydragen_cache_from_store(store, prompt, batch_size=N)
    finally:
        hydragen.eval()
        attention.attention_dropout = rate
    _assert_untouched(store, before)
