"""attn_implementation="hydragen" + HydragenCache inside HF generate: same tokens as standard generation, shared KV
stored once (counted in bytes), prefixes fed from outside, padding, and bad input."""

import pytest
import torch
from hydragen_helpers import assert_hydragen_refused, generate_seeded, prefix_tensors
from hydragen_helpers import assert_same as _assert_same
from transformers import (
    DynamicCache,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from prefixlab.attention import HydragenCache
from prefixlab.attention.hf_cache import SharedPrefixLayer
from prefixlab.errors import InvalidInputError

VOCAB, KV_HEADS, HEAD_DIM = 128, 2, 16
MAX_NEW_TOKENS = 8


def _llama():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, pad_token_id=0)


def _qwen35():
    return Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, pad_token_id=0)


def _lfm2():  # short convolutions: a conv state, no recurrent state
    return Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=KV_HEADS, conv_L_cache=3, pad_token_id=0,
                      layer_types=["conv", "full_attention", "conv"])


MODELS = {"llama": (LlamaForCausalLM, _llama), "qwen3_5": (Qwen3_5ForCausalLM, _qwen35),
          "lfm2": (Lfm2ForCausalLM, _lfm2)}


def _rows_share_bits(hydragen, ids, seed, groups, **kwargs) -> bool:
    """Whether the hydragen model's own run of the same generate call, not sharing (share_new_tokens=False), gives
    the rows of each group bit-identical prefill keys and values over its columns in every attention layer. Sharing
    is found by bits, and whether identical inputs come out bit-identical in different batch rows depends on the
    kernels (the BLAS, transformers' CPU fallback for Gated DeltaNet) and even on the run (on an Intel CPU a
    DynamicCache run gave a beam group identical rows where the same call under HydragenCache did not), so the exact
    sharing is asserted only where the same computation shows it; exactness is asserted everywhere. (The prefill's
    tensors: after beam search reorders rows, the cache's rows may all be copies of one.)"""
    cache, prefill = HydragenCache(hydragen.config, share_new_tokens=False), []
    for layer in cache.layers:
        if isinstance(layer, SharedPrefixLayer):
            layer.update = _recording(layer.update, prefill)
    _generate(hydragen, ids, seed, cache, **kwargs)
    return all(len({tensor[row, :, columns].numpy().tobytes() for row in rows}) == 1
               for tensor in prefill for rows, columns in groups)


def _recording(update, prefill: list):
    def recorded(keys, values, *args, **kwargs):
        if keys.shape[-2] > 1:  # the prefill's (decode steps add one column)
            prefill.extend((keys.clone(), values.clone()))
        return update(keys, values, *args, **kwargs)
    return recorded


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    """(standard sdpa model, the same weights with attn_implementation="hydragen"), fp32, eval."""
    cls, config = MODELS[request.param]
    torch.manual_seed(0)
    standard = cls(config()).eval()
    hydragen = cls(config()).eval()
    hydragen.load_state_dict(standard.state_dict())
    hydragen.set_attn_implementation("hydragen")
    return standard, hydragen


def _attention_layers(model) -> int:
    return sum(kind == "full_attention" for kind in getattr(model.config, "layer_types", None) or
               ["full_attention"] * model.config.num_hidden_layers)


def _kv_bytes(model, tokens: int) -> int:
    """Bytes of fp32 keys + values of `tokens` tokens in every attention layer, for ONE sequence."""
    return _attention_layers(model) * 2 * KV_HEADS * HEAD_DIM * 4 * tokens


def _generate(model, ids, seed, cache=None, **kwargs):
    return generate_seeded(model, ids, seed, cache, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW_TOKENS),
                           **kwargs)


def test_sampled_completions_share_the_prompt_once(pair):
    standard, hydragen = pair
    prompt = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    n = 6
    cache = HydragenCache(hydragen.config)
    out = _generate(hydragen, prompt, 7, cache, do_sample=True, num_return_sequences=n)
    _assert_same(_generate(standard, prompt, 7, do_sample=True, num_return_sequences=n), out)
    if _rows_share_bits(hydragen, prompt, 7, [(range(n), slice(0, 24))], do_sample=True, num_return_sequences=n):
        assert cache.shared_bytes() == _kv_bytes(hydragen, 24)  # the prompt, once (not n times)
        assert cache.per_sequence_bytes() == n * _kv_bytes(hydragen, MAX_NEW_TOKENS - 1)  # fed-back tokens
    standard_cache = DynamicCache(config=standard.config)
    _generate(standard, prompt, 7, standard_cache, do_sample=True, num_return_sequences=n)
    standard_bytes = sum(t.numel() * 4 for layer in standard_cache.layers if getattr(layer, "keys", None) is not None
                         for t in (layer.keys, layer.values))
    assert standard_bytes == n * _kv_bytes(hydragen, 24 + MAX_NEW_TOKENS - 1)


def test_greedy_batch_of_prompts_sharing_a_prefix(pair):
    standard, hydragen = pair
    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, VOCAB, (1, 20), generator=g)
    ids = torch.cat([system.repeat(4, 1), torch.randint(1, VOCAB, (4, 6), generator=g)], dim=1)
    cache = HydragenCache(hydragen.config)
    _assert_same(_generate(standard, ids, 0, do_sample=False), _generate(hydragen, ids, 0, cache, do_sample=False))
    if _rows_share_bits(hydragen, ids, 0, [(range(4), slice(0, 20))], do_sample=False):
        assert cache.shared_bytes() == _kv_bytes(hydragen, 20)
        assert cache.per_sequence_bytes() == 4 * _kv_bytes(hydragen, 6 + MAX_NEW_TOKENS - 1)


def test_prompts_times_samples_make_a_two_level_tree(pair):
    standard, hydragen = pair
    g = torch.Generator().manual_seed(3)
    common = torch.randint(1, VOCAB, (1, 10), generator=g)
    ids = torch.cat([common.repeat(2, 1), torch.randint(1, VOCAB, (2, 8), generator=g)], dim=1)
    cache = HydragenCache(hydragen.config)
    out = _generate(hydragen, ids, 4, cache, do_sample=True, num_return_sequences=3)
    _assert_same(_generate(standard, ids, 4, do_sample=True, num_return_sequences=3), out)
    layer = next(layer for layer in cache.layers if hasattr(layer, "levels"))
    groups = [(range(6), slice(0, 10)), (range(3), slice(10, 18)), (range(3, 6), slice(10, 18))]
    if _rows_share_bits(hydragen, ids, 4, groups[:1], do_sample=True, num_return_sequences=3):
        assert layer.levels[0].length == 10 and cache.shared_bytes() >= _kv_bytes(hydragen, 10)
    if _rows_share_bits(hydragen, ids, 4, groups, do_sample=True, num_return_sequences=3):
        assert [(level.length, level.parent) for level in layer.levels] == [(10, None), (8, 0), (8, 0)]
        assert cache.shared_bytes() == _kv_bytes(hydragen, 10 + 8 + 8)


def test_left_padding_stays_exact(pair):
    standard, hydragen = pair
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    cache = HydragenCache(hydragen.config)
    out = _generate(hydragen, ids, 5, cache, attention_mask=mask, do_sample=True, num_return_sequences=3)
    _assert_same(_generate(standard, ids, 5, attention_mask=mask, do_sample=True, num_return_sequences=3), out)
    groups = [(range(3), slice(0, 12)), (range(3, 6), slice(0, 12))]
    if _rows_share_bits(hydragen, ids, 5, groups, attention_mask=mask, do_sample=True, num_return_sequences=3):
        assert cache.shared_bytes() == _kv_bytes(hydragen, 2 * 12)  # each prompt once, its padding included


def test_prefix_fed_from_outside(pair):
    standard, hydragen = pair
    prompt = torch.randint(1, VOCAB, (1, 18), generator=torch.Generator().manual_seed(6))
    cache = HydragenCache(hydragen.config)
    cache.load_shared_prefix(**prefix_tensors(standard, prompt[:, :14]), batch_size=4)
    out = _generate(hydragen, prompt, 8, cache, do_sample=True, num_return_sequences=4)
    _assert_same(_generate(standard, prompt, 8, do_sample=True, num_return_sequences=4), out)
    if _rows_share_bits(hydragen, prompt, 8, [(range(4), slice(0, 18))], do_sample=True, num_return_sequences=4):
        assert cache.shared_bytes() == _kv_bytes(hydragen, 18)  # fed 14 + the 4 prompt tokens generate ran, once


def test_prefix_fed_then_prompts_branch(pair):
    """A store hit shared by two prompts, each sampled 3 times: fed level -> one level per prompt -> suffixes."""
    standard, hydragen = pair
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(1, VOCAB, (1, 12), generator=g)
    ids = torch.cat([prefix.repeat(2, 1), torch.randint(1, VOCAB, (2, 5), generator=g)], dim=1)
    cache = HydragenCache(hydragen.config)
    cache.load_shared_prefix(**prefix_tensors(standard, prefix), batch_size=6)
    out = _generate(hydragen, ids, 10, cache, do_sample=True, num_return_sequences=3)
    _assert_same(_generate(standard, ids, 10, do_sample=True, num_return_sequences=3), out)
    layer = next(layer for layer in cache.layers if hasattr(layer, "levels"))
    assert layer.levels[0].length == 12 and cache.shared_bytes() >= _kv_bytes(hydragen, 12)  # loaded: one copy
    groups = [(range(3), slice(12, 17)), (range(3, 6), slice(12, 17))]
    if _rows_share_bits(hydragen, ids, 10, groups, do_sample=True, num_return_sequences=3):
        assert [(level.length, level.parent) for level in layer.levels] == [(12, None), (5, 0), (5, 0)]
        assert layer.seq_levels.tolist() == [1, 1, 1, 2, 2, 2]


def test_beam_search(pair):
    """Beam reordering moves per-sequence suffixes only; the shared levels stay where they are."""
    standard, hydragen = pair
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(11))
    cache = HydragenCache(hydragen.config)
    out = _generate(hydragen, ids, 0, cache, do_sample=False, num_beams=3)
    assert torch.equal(_generate(standard, ids, 0, do_sample=False, num_beams=3).sequences, out.sequences)
    groups = [(range(3), slice(0, 10)), (range(3, 6), slice(0, 10))]
    if _rows_share_bits(hydragen, ids, 0, groups, do_sample=False, num_beams=3):
        assert cache.shared_bytes() == _kv_bytes(hydragen, 2 * 10)  # each prompt once for its 3 beams


def test_without_hydragen_cache_it_is_sdpa_bit_for_bit(pair):
    standard, hydragen = pair
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(standard(ids).logits, hydragen(ids).logits)


def test_bad_shared_prefix_raises_and_leaves_cache_empty(pair):
    standard, hydragen = pair
    prompt = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(8))
    tensors = prefix_tensors(standard, prompt[:, :6])
    cache = HydragenCache(hydragen.config)
    for bad in (0, True, 2.0):  # True was taken for 1
        with pytest.raises(InvalidInputError, match="batch_size"):
            cache.load_shared_prefix(**tensors, batch_size=bad)
    with pytest.raises(InvalidInputError, match="exactly the attention layers"):
        cache.load_shared_prefix(**{**tensors, "keys": {}}, batch_size=2)
    if tensors["conv_states"]:
        with pytest.raises(InvalidInputError, match="recurrent layers"):
            cache.load_shared_prefix(**{**tensors, "conv_states": {}}, batch_size=2)
        # Qwen3.5's layers need their recurrent states too; LFM2's short convs keep none, so none may be given
        wrong = {} if tensors["recurrent_states"] else dict(tensors["conv_states"])
        with pytest.raises(InvalidInputError, match="recurrent layers"):
            cache.load_shared_prefix(**{**tensors, "recurrent_states": wrong}, batch_size=2)
    assert cache.shared_bytes() == 0 and cache.get_seq_length() == 0
    cache.load_shared_prefix(**tensors, batch_size=2)
    with pytest.raises(InvalidInputError, match="empty cache"):
        cache.load_shared_prefix(**tensors, batch_size=2)
    with pytest.raises(InvalidInputError, match="batch_size=2"):
        _generate(hydragen, prompt, 0, cache, do_sample=True, num_return_sequences=3)
    with pytest.raises(InvalidInputError, match="set_attn_implementation"):
        HydragenCache(standard.config)


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_latent_attention_models_are_refused_with_what_to_use(family):
    """Kimi Linear's (and Ling's) MLA layers expand their cached latents before attending: a shared view crashed
    inside the model (AttributeError) on any batch with shared rows. Now refused up front; `--hydragen` serves such
    models one by one."""
    from hf_models import FAMILIES, config

    model = FAMILIES[family][1](config(family)).eval()
    assert_hydragen_refused(model, "multi-head latent attention.*HybridPrefixCache")


def test_right_padded_candidates_scored_over_a_loaded_prefix(pair):
    """Scoring candidates of different lengths after one shared prefix, right-padded in one forward, was refused:
    the position check read each row's last column, a pad. It now reads each row's last real token."""
    standard, hydragen = pair
    g = torch.Generator().manual_seed(11)
    prefix, candidates = torch.randint(3, VOCAB, (1, 10), generator=g), torch.randint(3, VOCAB, (3, 5), generator=g)
    lengths = [5, 3, 4]
    own = torch.zeros(3, 5, dtype=torch.long)
    for b, n in enumerate(lengths):
        own[b, :n] = 1
        candidates[b, n:] = 0
    mask = torch.cat([torch.ones(3, 10, dtype=torch.long), own], dim=1)
    cache = HydragenCache(hydragen.config)
    cache.load_shared_prefix(**prefix_tensors(standard, prefix), batch_size=3)
    with torch.no_grad():
        expected = standard(torch.cat([prefix.repeat(3, 1), candidates], dim=1), attention_mask=mask).logits[:, 10:]
        logits = hydragen(candidates, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    for b, n in enumerate(lengths):
        torch.testing.assert_close(logits[b, :n], expected[b, :n], atol=1e-5, rtol=0)


def test_a_refused_load_leaves_the_cache_empty_and_reset_takes_another_batch(pair):
    """A conv state of the wrong batch was refused after the attention levels were loaded (the corrected call was
    then refused as 'not empty'); after reset(), a batch of another size crashed in transformers' recurrent buffer."""
    standard, hydragen = pair
    prompt = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(12))
    tensors = prefix_tensors(standard, prompt[:, :10])
    cache = HydragenCache(hydragen.config)
    if tensors["conv_states"]:
        wrong = {i: state.expand(2, *state.shape[1:]) for i, state in tensors["conv_states"].items()}
        with pytest.raises(InvalidInputError, match="batch 1 or 3"):
            cache.load_shared_prefix(**{**tensors, "conv_states": wrong}, batch_size=3)
        assert cache.shared_bytes() == 0 and cache.get_seq_length() == 0 and cache.expected_batch is None
    for batch in (3, 2):
        cache.load_shared_prefix(**tensors, batch_size=batch)
        _assert_same(_generate(standard, prompt.repeat(batch, 1), 0, do_sample=False),
                     _generate(hydragen, prompt.repeat(batch, 1), 0, cache, do_sample=False))
        cache.reset()


def test_minimax_is_refused_with_what_to_use():
    """MiniMax's model takes only its own MiniMaxCache: a HydragenCache is refused up front, and the fleet does not
    batch its siblings through one."""
    from hf_models import build

    assert_hydragen_refused(build("minimax"), "MiniMaxCache.*HybridPrefixCache")


def test_a_model_that_caps_its_attention_scores_is_refused():
    """Gemma 2's attn_logit_softcapping was dropped over a loaded prefix (greedy tokens differed from eager)."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_logit_softcapping=1.0)
    config._attn_implementation = "hydragen"
    with pytest.raises(InvalidInputError, match="attn_logit_softcapping"):
        HydragenCache(config)


def test_attention_sinks_are_refused_not_dropped():
    """gpt-oss' attention sinks (`s_aux`) were dropped by attn_implementation="hydragen", with or without a
    HydragenCache (logits 0.26 off eager)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["full_attention"] * 2, pad_token_id=0)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    model.set_attn_implementation("hydragen")
    ids = torch.randint(1, VOCAB, (2, 6))
    for cache in (None, HydragenCache(model.config)):
        with pytest.raises(InvalidInputError, match="s_aux"), torch.no_grad():
            model(ids, past_key_values=cache)


def test_inkling2_sinks_are_refused_not_dropped():
    """Inkling2's per-head sink logits reach the attention interface as `sinks` (gpt-oss': `s_aux`)."""
    from prefixlab.attention.hf import hydragen_attention_forward

    query = key = value = torch.zeros(1, 2, 3, 8)
    with pytest.raises(InvalidInputError, match="sinks"):
        hydragen_attention_forward(torch.nn.Module(), query, key, value, None, sinks=torch.zeros(1, 2, 3, 1))
