"""Qwen4-Exp's own state beyond GatedDeltaNet's: the QSA indexer's cached keys and position history, and the PLE
n-gram context / conv states (tests/hf_models.py "qwen4_exp"); the shared family tests cover the rest."""

import pytest
import torch
from hf_models import build, tokens
from test_hf_cache_padding import left_pad

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore

OPTIONS = dict(do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)


def assert_same(got, expected):
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("patch", [True, False])
def test_a_row_resuming_nothing_right_after_its_pads_starts_from_a_fresh_ngram_context(patch):
    """Row 0 resumes its cached prefix (d tokens) at column d, where row 1's real tokens start after d pads with
    nothing cached: row 1 starts fresh in the same forward, its n-gram context the eos ids a fresh sequence starts
    with (not the zeros of other states: pad id 0 would be read as its context), and its indexer positions at 0."""
    model = build("qwen4_exp")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=patch)
    cached = tokens(11, seed=1)
    model.generate(cached[None], past_key_values=HybridPrefixCache(store), max_new_tokens=3, **OPTIONS)
    first = torch.cat([cached, tokens(9, seed=2)])
    store.flush()
    depth = store.core.peek(first[:-1].numpy())[0]
    batch, mask = left_pad([first, tokens(len(first) - depth, seed=3)])  # row 1: `depth` pads
    cache = HybridPrefixCache(store)
    got = model.generate(batch, attention_mask=mask, past_key_values=cache, max_new_tokens=4, **OPTIONS)
    assert depth >= 10 and cache.rows_reused == [depth, 0]
    assert_same(got, model.generate(batch, attention_mask=mask, max_new_tokens=4, **OPTIONS))


def test_a_saved_store_reloads_the_indexer_keys(tmp_path):
    """store.save / PrefixStore.load keep the indexer keys beside K and V: a reloaded store resumes exactly."""
    model = build("qwen4_exp")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(20, seed=4)
    for _ in range(2):
        model.generate(prompt[None], past_key_values=HybridPrefixCache(store), max_new_tokens=3, **OPTIONS)
    store.save(tmp_path / "store.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    follow = torch.cat([prompt, tokens(5, seed=5)])[None]
    cache = HybridPrefixCache(loaded)
    got = model.generate(follow, past_key_values=cache, max_new_tokens=4, **OPTIONS)
    assert cache.reused_tokens >= 19
    assert_same(got, model.generate(follow, max_new_tokens=4, **OPTIONS))


def test_with_its_vision_tower_text_is_reused_up_to_the_first_image():
    """Qwen4-Exp's composite model: the indexer's position history is rebuilt as text positions on a resume, so
    images are not keyed by content (as on Qwen3.5) and a prompt is reused only up to its first placeholder; text
    and image prompts are exact against the model without prefixlab."""
    from multimodal_helpers import END, GRID_4, IMAGE, START, build_model

    model = build_model("qwen4_exp")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    text = (tokens(12, seed=6) % 100 + 3).tolist()  # (no placeholder ids among them)
    ids = torch.tensor([text + [START] + [IMAGE] * 4 + [END] + (tokens(5, seed=7) % 100 + 3).tolist()])
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(8))
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=GRID_4, max_new_tokens=3, **OPTIONS)
    for _ in range(3):
        cache = HybridPrefixCache(store)
        assert_same(model.generate(**inputs, past_key_values=cache), model.generate(**inputs))
    assert 0 < cache.reused_tokens <= len(text) + 1


def test_hydragen_refuses_indexed_attention():
    """Hydragen attention computes no per-query selection: refused, and sibling batching falls back to one prompt
    at a time."""
    from hydragen_helpers import assert_hydragen_refused

    assert_hydragen_refused(build("qwen4_exp"), "token indexer")


def test_a_config_without_the_indexer_fields_is_refused_with_the_reason():
    """transformers' default Qwen4ExpTextConfig has indexed_attention layers but no QSA fields (its model cannot be
    built either): the cost model says so instead of failing on a None."""
    import transformers as tf

    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="QSA indexer_"):
        ModelSpec.from_config(tf.Qwen4ExpTextConfig())


def test_ple_input_ids_are_refused():
    """The hooks shorten input_ids to the tokens not held; a separate ple_input_ids would not be: refused."""
    from prefixlab.errors import InvalidInputError

    model = build("qwen4_exp")
    store = PrefixStore(model, capacity="64MB")
    ids = tokens(1, 8, seed=9)
    with pytest.raises(InvalidInputError, match="ple_input_ids"):
        model(input_ids=ids, ple_input_ids=ids, past_key_values=HybridPrefixCache(store))
    assert store.stats()["requests"] == 0


def test_indexer_ties_are_broken_alike_in_forwards_of_any_length():
    """The QSA indexer scores ReLU'd sums that tie exactly at 0 (as GLM-5-Next's DSA ones, which break ties by the
    forward's length: README "Sparse attention"); but each query's topk runs over its own visible complete blocks
    only (modeling_qwen4_exp.py :733-754), the same in a forward of any length. With the indexer's queries zeroed
    every block ties: a reused 24-token prefix (budget: 2 blocks of 2 keys) is still exact, no admit limit."""
    model = build("qwen4_exp")
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.layer_type == "indexed_attention":
                indexer = layer.self_attn.indexer
                indexer.index_qk_proj.weight[: indexer.index_n_heads * indexer.index_head_dim] = 0
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    assert store.admit_limit == float("inf")
    system = tokens(24, seed=10)
    for seed in (11, 12, 13):
        prompt = torch.cat([system, tokens(6, seed=seed)])[None]
        cache = HybridPrefixCache(store)
        assert_same(model.generate(prompt, past_key_values=cache, max_new_tokens=4, **OPTIONS),
                    model.generate(prompt, max_new_tokens=4, **OPTIONS))
    assert cache.reused_tokens >= 24
