"""prefixlab.recurrent.patch against the same models without prefixlab (fp32, tolerance 1e-5)."""

from __future__ import annotations

import pytest
import torch
from recurrent_patch_models import (
    CONFIGS,
    TOL,
    RecordingCache,
    assert_close,
    assert_same_states,
    build,
    forward,
    linear_layer_indices,
    new_cache,
    reference_states,
    states,
    tokens,
)

from prefixlab.recurrent.patch import patch, patched, unpatch

FAMILIES = sorted(CONFIGS)


GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    """(name, patched model, token ids, logits and greedy generation of the ids computed before patching)."""
    model = build(request.param)
    ids = tokens(2, 21)
    reference = forward(model, ids)
    with torch.no_grad():
        generated = model.generate(ids[:, :10], **GREEDY)
    decoded = decode_steps(model, ids)
    patch(model)
    yield request.param, model, ids, (reference, generated, decoded)
    unpatch(model)


def decode_steps(model, ids, prefill: int = 9) -> torch.Tensor:
    """Logits of a prefill of ids[:, :prefill], then of each later token fed alone over the cache."""
    cache = new_cache(model)
    pieces = [forward(model, ids[:, :prefill], cache)]
    pieces += [forward(model, ids[:, t : t + 1], cache, start=t) for t in range(prefill, ids.shape[1])]
    return torch.cat(pieces, dim=1)


def test_patched_forward_equals_unpatched(family_model):
    _, model, ids, (reference, _, _) = family_model
    assert_close(forward(model, ids), reference)
    assert_close(forward(model, ids, cache=new_cache(model)), reference)


def test_greedy_generation_is_unchanged(family_model):
    _, model, ids, (_, generated, _) = family_model
    with torch.no_grad():
        assert torch.equal(model.generate(ids[:, :10], **GREEDY), generated)


def test_decode_steps_equal_transformers_decode_steps(family_model):
    """One token over a cached state is a decode step in transformers: Nemotron-H's and Zamba2's Mamba2 mixers do not
    clamp dt to their time_step_limit there, as they do in a prefill, so the patch must not either."""
    _, model, ids, (_, _, decoded) = family_model
    assert_close(decode_steps(model, ids), decoded)


def test_continuing_from_the_cache_equals_one_forward(family_model):
    """Prefill tokens[:9], then 4 tokens, 1 token and the rest, each from the cached state."""
    _, model, ids, (reference, _, _) = family_model
    cache, pieces = new_cache(model), []
    for start, stop in [(0, 9), (9, 13), (13, 14), (14, 21)]:
        pieces.append(forward(model, ids[:, start:stop], cache, start=start))
    assert_close(torch.cat(pieces, dim=1), reference)


def test_captured_states_equal_the_states_a_shorter_forward_leaves(family_model):
    """Offsets in a 5-token prefill (0: the zero state) and in the forward continuing it (0: the cached state after
    the prefill, 16: its end)."""
    _, model, ids, _ = family_model
    prefix, prefill_offsets, offsets = 5, [0, 3], [0, 6, 16]
    cache = RecordingCache(model, prefill_offsets)
    forward(model, ids[:, :prefix], cache)
    prefill_records, cache.records = cache.records, {}
    cache.prefixlab_capture_positions = offsets
    forward(model, ids[:, prefix:], cache, start=prefix)
    cache.prefixlab_capture_positions = None
    forward(model, ids[:, :3], cache, start=ids.shape[1])  # the cache moves on: records must not alias it
    layers = linear_layer_indices(cache)
    assert set(prefill_records) == {(layer, offset, None) for layer in layers for offset in prefill_offsets}
    assert set(cache.records) == {(layer, offset, None) for layer in layers for offset in offsets}
    for layer in layers:
        conv, recurrent = prefill_records[(layer, 0, None)]
        if conv is not None and conv.dtype == torch.int64:  # Qwen4-Exp's n-gram context of token ids starts as eos ids
            assert conv.eq(model.config.get_text_config().eos_token_id).all() and recurrent is None
            continue
        assert (conv is None or not conv.any()) and (recurrent is None or not recurrent.any())
    for records, start, offset in [(prefill_records, 0, 3)] + [(cache.records, prefix, o) for o in offsets]:
        expected = reference_states(model, ids[:, : start + offset])
        for layer in layers:
            assert_same_states(records[(layer, offset, None)], states(expected, layer))


@pytest.mark.parametrize("name", ["jamba", "falcon_mamba", "mamba", "zamba"])
def test_mamba1_models_need_the_patch_to_resume(name):
    """transformers' Mamba1 torch path restarts its scan from zeros for multi-token forwards, so a cached prefix
    is only resumed exactly once patched (if this starts failing on the unpatched side, transformers fixed it)."""
    model, ids = build(name), tokens(2, 16)
    reference = forward(model, ids)

    def resumed():
        cache = new_cache(model)
        return torch.cat([forward(model, ids[:, :7], cache), forward(model, ids[:, 7:], cache, start=7)], dim=1)

    assert (resumed() - reference).abs().max() > 100 * TOL  # (Mamba, no dt / B / C norms: 4e-3; others > 1e-2)
    with patched(model):
        assert_close(resumed(), reference)
