"""MiniMax through HybridPrefixCache: its MiniMaxCache adapter (cache/hf_minimax.py), lightning-attention states as
the store's recurrent states, and where transformers' own MiniMaxCache computes otherwise than one forward."""

import pytest
import torch
from hf_models import build, reference_cache
from test_hf_families import TOLERANCE, assert_same, generate

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import UnsupportedModelError


def test_minimax_caches_are_minimax_caches_that_keep_its_states_on_the_cache_layers():
    """MiniMaxModel.forward takes only its MiniMaxCache: HybridPrefixCache(store), and an unbound cache once bound,
    is one (hf_minimax.py), whose lightning-attention states are the store's recurrent states (no conv state)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model = build("minimax")
    store = PrefixStore(model, block_size=4, patch=False)
    assert store.layout.conv_layers == () and store.layout.recurrent_layers == (0, 1, 2)
    unbound, prompt = HybridPrefixCache(), torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    assert type(unbound) is HybridPrefixCache
    for cache in (HybridPrefixCache(store), unbound):
        generate(model, prompt, cache, max_new_tokens=2)
        assert isinstance(cache, MiniMaxCache) and isinstance(cache, HybridPrefixCache)
        assert cache.layers[0].recurrent_states[0] is not None and cache.layers[0].conv_states[0] is None
    assert unbound.reused_tokens > 0
    store.close()


def test_minimax_default_cache_masks_left_padded_decode_steps_wrongly():
    """Why MiniMax's uncached reference runs over hf_models.reference_cache: with its default MiniMaxCache()
    (transformers 5.23) a left-padded row's decode steps differ from one forward over its whole sequence, over a
    cache built from the config they do not (if the first assertion starts failing, transformers fixed it)."""
    from test_hf_cache_padding import left_pad

    model, rng = build("minimax"), torch.Generator().manual_seed(7)
    batch, mask = left_pad([torch.randint(3, 128, (n,), generator=rng) for n in (9, 11)])
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)

    def decode_error(cache):
        out = model.generate(batch, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=4,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                             past_key_values=cache)
        with torch.no_grad():  # the same tokens in one forward, no cache
            logits = model(out.sequences[:, :-1], attention_mask=full_mask,
                           position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0), use_cache=False).logits
        return (torch.stack(out.logits, dim=1) - logits[:, batch.shape[1] - 1:]).abs().max().item()

    with torch.no_grad():
        assert decode_error(None) > 100 * TOLERANCE
        assert decode_error(reference_cache(model)) <= TOLERANCE


def test_minimax_beam_search_reuses_and_reorders_its_states():
    """Beam search reorders the lightning states with the KV (transformers 5.23's MiniMaxCache does not: its
    `linear_cache` list is left out of Cache.reorder_cache, so its beams continue other beams' states; if the first
    assertion starts failing, transformers fixed it)."""
    model, prompt = build("minimax"), torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    store = PrefixStore(model, block_size=4)

    def beams(cache=None):
        served = {} if cache is None else {"past_key_values": cache}
        return model.generate(prompt, max_new_tokens=4, num_beams=2, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **served)

    with torch.no_grad():
        reference = beams(reference_cache(model))
        default = beams()  # (transformers' own MiniMaxCache)
        assert max((a - b).abs().max().item()
                   for a, b in zip(default.logits, reference.logits, strict=True)) > 100 * TOLERANCE
        generate(model, prompt, HybridPrefixCache(store))
        cache = HybridPrefixCache(store)
        assert_same(reference, beams(cache))
    assert cache.reused_tokens == 29  # (all but the prompt's last token)
    store.close()


def test_minimax_with_a_sliding_window_is_refused():
    model = build("minimax")
    model.config.sliding_window = 8
    with pytest.raises(UnsupportedModelError, match="sliding_window=None"):
        PrefixStore(model)
