"""GLM-5-Next: the DSA indexer's per-token keys travel with the KV, and nothing past its selection limit is reused.

The tiny model here selects 2 pools of 4 keys (+ the tail) per query, so tokens from 11 on attend sparsely
(hfspec.selection_limit). Its ReLU'd pool scores tie at 0 often, and transformers' topk breaks ties by the length of
the forward: the same tokens split into two forwards compute otherwise than in one (pinned down below; if a
transformers release makes the selection causal, that test fails and the limit can go).
"""

import pytest
import torch
from hf_models import _COMMON, FAMILIES, generate, tokens
from transformers import DynamicCache

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.hfspec import selection_limit
from prefixlab.cache.model_info import CacheLayout
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import InvalidInputError

LIMIT = 11  # (8 // 4 + 1) * 4 - 1


def build(**overrides) -> torch.nn.Module:
    config_class, model_class, family = FAMILIES["glm5_next"]
    torch.manual_seed(0)
    return model_class(config_class(**(_COMMON | family | {"index_topk": 8} | overrides))).eval()


def served(model, prompt, cache=None):
    return generate(model, prompt, cache, max_new_tokens=4, output_logits=True, return_dict_in_generate=True)


def assert_same(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    for mine, theirs in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def split_error(model, prompt: torch.Tensor, at: int) -> float:
    """Max logit difference of one forward over `prompt` and two (at `at`) over a DynamicCache."""
    with torch.no_grad():
        whole = model(prompt).logits
        cache = DynamicCache(config=model.config)
        parts = [model(prompt[:, :at], past_key_values=cache).logits,
                 model(prompt[:, at:], past_key_values=cache).logits]
    return (torch.cat(parts, dim=1) - whole).abs().max().item()


def test_the_selection_limit_and_the_layout():
    model = build()
    assert selection_limit(model.config) == LIMIT and selection_limit(FAMILIES["qwen3_5"][0]()) is None
    layout = CacheLayout.from_config(model.config)  # layer 2 reuses layer 1's selection: no indexer keys
    assert layout.kv_layers == (1, 2) and layout.indexer_layers == (1,) and layout.state_layers == (0, 3)


def test_transformers_selection_depends_on_the_forward_length_past_the_limit():
    model, prompt = build(), tokens(1, 29, seed=7)
    assert split_error(model, prompt, 8) <= 1e-5  # every token a query may see selected: causal
    assert split_error(model, prompt, 24) > 1e-3  # tokens 14-23 pick other pools in a 24-token forward


@pytest.mark.parametrize("patch", [True, False])
def test_reuse_stops_at_the_selection_limit_and_is_exact(patch):
    """Questions over a 24-token system prompt reuse its first 11 tokens, never more; a follow-up turn too."""
    model = build()
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=patch)
    system, reused, caches = tokens(1, 24, seed=1), [], []
    for seed in range(3):
        prompt = torch.cat([system, tokens(1, 5, seed=10 + seed)], dim=1)
        caches.append(cache := HybridPrefixCache(store))
        out = served(model, prompt, cache)
        reused.append(cache.reused_tokens)
        assert_same(out, served(model, prompt))
    follow_up = torch.cat([out.sequences, tokens(1, 3, seed=20)], dim=1)
    caches.append(cache := HybridPrefixCache(store))
    assert_same(served(model, follow_up, cache), served(model, follow_up))
    assert reused == [0, LIMIT, LIMIT] and cache.reused_tokens == LIMIT  # a state is kept at the limit
    # every token held past the limit is left out, counted as such (not as decoded tokens left out)
    left_out, report = cache.held_tokens().shape[1] - store.admit_limit, str(cache.report())
    assert f"{left_out} tokens left out past a media placeholder or the model's store.admit_limit" in report
    stats = store.stats()
    assert stats["limited_tokens_left_out"] == sum(c.report().limited_left_out for c in caches) > 0
    assert stats["decoded_tokens_left_out"] == 0 and all(c.report().decoded_left_out == 0 for c in caches)
    store.core.check_invariants()


def test_indexer_keys_survive_save_and_load(tmp_path):
    model = build(index_topk=32)  # limit 35: the whole prompt is reused
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 20, seed=3)
    served(model, prompt, HybridPrefixCache(store))
    store.save(tmp_path / "glm5.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "glm5.safetensors", model)
    cache = HybridPrefixCache(loaded)
    assert_same(served(model, prompt, cache), served(model, prompt))
    assert cache.reused_tokens == prompt.shape[1] - 1


def test_an_image_prompt_reuses_the_text_before_the_image():
    """NoPE, no M-RoPE: images are not keyed by content (multimodal.py), a prompt is reused up to its first one."""
    model = build(index_topk=32, image_token_id=120, video_token_id=121, image_start_token_id=122,
                  image_end_token_id=123, video_start_token_id=124, video_end_token_id=125)
    store = PrefixStore(model, capacity="64MB", policy="dp")
    ids = torch.tensor([list(range(5, 17)) + [122] + [120] * 4 + [123] + list(range(30, 36))])
    image = dict(pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)),
                 image_grid_thw=torch.tensor([[1, 4, 4]]))  # 16 patches of 14, merged 2 x 2: 4 placeholders
    want = generate(model, ids, max_new_tokens=4, output_logits=True, return_dict_in_generate=True, **image)
    for expected_reuse in (0, 12):
        cache = HybridPrefixCache(store)
        assert_same(generate(model, ids, cache, max_new_tokens=4, output_logits=True, return_dict_in_generate=True,
                             **image), want)
        assert cache.reused_tokens == expected_reuse


def test_a_direct_admission_past_the_limit_is_refused():
    model = build()
    store = PrefixStore(model, capacity="64MB")
    with pytest.raises(InvalidInputError, match="admit at most that many"):
        store.admit(list(range(3, 3 + LIMIT + 1)), kv=lambda a, b: None, states={})


def test_the_simulator_reuses_no_more_than_a_store_would():
    """The cost model carries the limit (ModelSpec.reuse_limit): a replay and the infinite-cache ceiling reused
    whole 30-token prompts of a model whose store reuses at most 11 of them."""
    import numpy as np

    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.sim.replay import ceiling, simulate
    from prefixlab.sim.trace import Request

    spec = ModelSpec.from_config(build().config)
    assert spec.reuse_limit == LIMIT and ModelSpec.from_config(FAMILIES["qwen3_5"][0]()).reuse_limit is None
    prompt = np.arange(3, 33, dtype=np.int64)
    requests = [Request("a", 0, 0.0, prompt, prompt[:2]), Request("b", 0, 1.0, prompt.copy())]
    assert ceiling(requests, spec).reused_tokens == LIMIT
    for policy in ("dp", "vllm+", "sglang+"):
        assert 0 < simulate(requests, policy, 10**9, spec, block_size=4).reused_tokens <= LIMIT
