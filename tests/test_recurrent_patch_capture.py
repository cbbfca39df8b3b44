"""Capture under left padding (per-row offsets) and, property-based, at any split and any offsets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_patch_models import (
    RecordingCache,
    assert_close,
    assert_same_states,
    build,
    forward,
    linear_layer_indices,
    reference_states,
    states,
    tokens,
)

from prefixlab.recurrent import patch, patched

PADDED_FAMILIES = [
    "qwen3_5_text", "bamba", "kimi_linear", "lfm2", "zaya", "inkling_text", "inkling2_text", "qwen4_exp_text",
    "minimax",
]


def left_padded(length: int, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, length] and attention mask with pads[b] leading pad tokens in row b."""
    ids = tokens(len(pads), length, seed=3)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize("name", PADDED_FAMILIES)
def test_left_padding_and_per_row_capture(name):
    model = build(name)
    ids, mask = left_padded(14, pads=[3, 0])
    reference = forward(model, ids, attention_mask=mask)
    offsets = [[3, 5, 9], [0, 9, 14]]  # row 0: after its pads, and two points inside its tokens
    with patched(model):
        assert_close(forward(model, ids, attention_mask=mask), reference)
        cache = RecordingCache(model, offsets)
        forward(model, ids, cache, attention_mask=mask)
        layers = linear_layer_indices(cache)
        assert set(cache.records) == {(layer, o, row) for layer in layers for row in (0, 1) for o in offsets[row]}
        for row, row_offsets in enumerate(offsets):
            for offset in (o for o in row_offsets if o > 0):  # there is no forward over 0 tokens
                expected = reference_states(model, ids[:, :offset], attention_mask=mask[:, :offset])
                for layer in layers:
                    want = tuple(None if s is None else s[row : row + 1] for s in states(expected, layer))
                    assert_same_states(cache.records[(layer, offset, row)], want)
        if name == "qwen4_exp_text":  # the PLE layer's further states are among the slots checked
            assert {(0, 1), (0, 2)} <= set(layers)


@pytest.fixture(scope="module", params=["qwen3_5_text", "bamba"])
def patched_model(request):
    model = build(request.param)
    ids = tokens(1, 24, seed=5)
    reference = forward(model, ids)
    patch(model)
    return model, ids, reference


@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_split_and_any_offsets_are_exact(patched_model, data):
    """Resume after p tokens: the logits match one forward, and states recorded at any offsets of the resumed
    forward equal the states of forwards that stop there."""
    model, ids, reference = patched_model
    length = ids.shape[1]
    p = data.draw(st.integers(1, length - 1), label="split")
    offsets = sorted(data.draw(st.sets(st.integers(0, length - p), max_size=3), label="offsets"))
    cache = RecordingCache(model, None)
    head = forward(model, ids[:, :p], cache)
    cache.prefixlab_capture_positions = offsets
    tail = forward(model, ids[:, p:], cache, start=p)
    assert_close(torch.cat([head, tail], dim=1), reference)
    for offset in offsets:
        expected = reference_states(model, ids[:, : p + offset])
        for layer in linear_layer_indices(cache):
            assert_same_states(cache.records[(layer, offset, None)], states(expected, layer))


@pytest.mark.parametrize("name", ["kimi_linear", "bamba", "jamba"])
def test_bfloat16_models_record_states_in_the_dtypes_their_cache_keeps(name):
    """bf16 weights: conv states stay bf16 and recurrent states float32, as in transformers' cache; outputs agree
    with the unpatched model to bf16 rounding."""
    model, ids = build(name, dtype=torch.bfloat16), tokens(2, 12)
    reference = forward(model, ids).float()
    with patched(model):
        assert (forward(model, ids).float() - reference).abs().max() < 5e-2
        cache = RecordingCache(model, [4, 12])
        forward(model, ids, cache)
    for layer in linear_layer_indices(cache):
        for offset in (4, 12):
            conv, recurrent = cache.records[(layer, offset, None)]
            stored_conv, stored_recurrent = states(cache, layer)
            assert conv.dtype == stored_conv.dtype == torch.bfloat16
            assert recurrent.dtype == stored_recurrent.dtype == torch.float32
        assert torch.equal(cache.records[(layer, 12, None)][1], states(cache, layer)[1])


@pytest.mark.parametrize("scan_backend, expected", [("torch", torch.float32), ("mamba_ssm", torch.bfloat16)])
def test_mamba2_scans_in_float32_unless_mamba_ssm_runs_them_in_the_models_dtype(monkeypatch, scan_backend, expected):
    """A bf16 Mamba2 layer: prefixlab's torch kernels get float32 inputs (transformers' torch path), mamba_ssm gets
    the model's bf16 (transformers' CUDA path): it never sees float32, which Triton would compute in TF32."""
    from prefixlab.recurrent.families import mamba2

    seen, ssd = [], mamba2.ssd

    def recording_ssd(x, *args, **kwargs):  # records the dtype, then scans with the torch kernel (no GPU here)
        seen.append(x.dtype)
        return ssd(x, *args, **{**kwargs, "backend": "torch"})

    monkeypatch.setattr(mamba2, "ssd", recording_ssd)
    monkeypatch.setattr(mamba2, "ssd_backend", lambda backend, device, dtype, tokens: scan_backend)
    model, ids = build("bamba", dtype=torch.bfloat16), tokens(1, 12)
    with patched(model):
        forward(model, ids)
    assert seen and set(seen) == {expected}
