"""patch / unpatch / patched: idempotence, reversibility, accelerate hooks, refused layers and bad input."""

from __future__ import annotations

import pytest
import torch
from recurrent_patch_models import (
    RecordingCache,
    assert_close,
    build,
    forward,
    linear_layer_indices,
    new_cache,
    states,
    tokens,
)
from torch import nn

from prefixlab.errors import InvalidInputError, UnsupportedModelError
from prefixlab.recurrent import patch, patched, unpatch
from prefixlab.recurrent.patch import is_patched, linear_attention_layers


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_5_text")


def layer_forwards(model):
    return [vars(layer).get("forward") for layer, _ in linear_attention_layers(model)]


def test_patch_is_idempotent_and_unpatch_restores_the_class_forward(qwen):
    ids = tokens(1, 12)
    reference = forward(qwen, ids)
    assert not is_patched(qwen) and all(f is None for f in layer_forwards(qwen))
    patch(qwen)
    first = layer_forwards(qwen)
    patch(qwen)  # again: same layers, a fresh forward each, one saved original
    assert is_patched(qwen) and qwen.prefixlab_patched and all(f is not None for f in first)
    assert_close(forward(qwen, ids), reference)
    unpatch(qwen)
    assert not is_patched(qwen) and not hasattr(qwen, "prefixlab_patched")
    assert all(f is None for f in layer_forwards(qwen))
    assert torch.equal(forward(qwen, ids), reference)
    unpatch(qwen)  # no-op on an unpatched model


def test_patched_context_restores_on_error_and_keeps_an_earlier_patch(qwen):
    with pytest.raises(RuntimeError, match="inside"):
        with patched(qwen):
            assert is_patched(qwen)
            raise RuntimeError("inside")
    assert not is_patched(qwen)
    patch(qwen)
    with patched(qwen):
        pass
    assert is_patched(qwen)
    unpatch(qwen)


def test_patch_swaps_accelerates_inner_forward_when_hooked(qwen):
    layer = qwen.model.layers[0].linear_attn
    hooked = layer.forward  # what accelerate's add_hook_to_module keeps as _old_forward
    layer._hf_hook, layer._old_forward = object(), hooked
    try:
        patch(qwen)
        assert layer._old_forward is not hooked and "forward" not in vars(layer)
        unpatch(qwen)
        assert layer._old_forward is hooked
    finally:
        del layer._hf_hook, layer._old_forward


class UnknownMixer(nn.Module):
    """Looks like a linear-attention layer (depthwise conv + layer_idx) but no family serves it."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv1d = nn.Conv1d(8, 8, kernel_size=4, groups=8)


class Qwen3_5GatedDeltaNet(UnknownMixer):
    """Remote code reusing transformers' class name must not be taken for transformers' layer."""


@pytest.mark.parametrize("layer_class", [UnknownMixer, Qwen3_5GatedDeltaNet])
def test_unknown_linear_attention_layers_are_refused_and_nothing_is_patched(qwen, layer_class):
    qwen.model.layers[1].extra_mixer = layer_class(1)
    try:
        with pytest.raises(UnsupportedModelError, match=layer_class.__qualname__):
            patch(qwen)
        assert not is_patched(qwen)
    finally:
        del qwen.model.layers[1].extra_mixer


class Mamba2(UnknownMixer):
    """What AutoModel builds for a Mamba2 config once fla is imported: fla's layer, not transformers'."""


Mamba2.__module__ = "fla.layers.mamba2"


def test_an_fla_layer_is_refused_with_how_to_build_transformers_model(qwen):
    qwen.model.layers[1].extra_mixer = Mamba2(1)
    try:
        with pytest.raises(UnsupportedModelError, match=r"fla\.layers\.mamba2\.Mamba2 .*transformers\.Mamba2ForCausal"):
            patch(qwen)
        assert not is_patched(qwen)
    finally:
        del qwen.model.layers[1].extra_mixer


def test_models_without_linear_attention_are_left_alone():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 3))
    assert patch(mlp) is mlp and not is_patched(mlp)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: patch(m, backend="fast"), "backend"),
        (lambda m: patch("model"), "torch.nn.Module"),
    ],
)
def test_bad_patch_arguments(qwen, call, match):
    with pytest.raises(InvalidInputError, match=match):
        call(qwen)
    assert not is_patched(qwen)


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([3, 1], "sorted and distinct"),
        ([0, 9], r"in \[0, 8\]"),
        ([1.0], "ints"),
        ([[1], [2], [3]], "2 lists"),
        ("12", "list of ints"),
    ],
)
def test_bad_capture_positions_raise_and_leave_the_cache_unchanged(qwen, positions, match):
    ids = tokens(2, 12)
    with patched(qwen):
        cache = RecordingCache(qwen, None)
        forward(qwen, ids[:, :4], cache)
        before = [states(cache, layer) for layer in linear_layer_indices(cache)]
        cache.prefixlab_capture_positions = positions
        with pytest.raises(InvalidInputError, match=match):
            forward(qwen, ids[:, 4:], cache, start=4)
        after = [states(cache, layer) for layer in linear_layer_indices(cache)]
        assert cache.get_seq_length() == 4 and not cache.records
        for (conv_before, rec_before), (conv_after, rec_after) in zip(before, after, strict=True):
            assert torch.equal(conv_before, conv_after) and torch.equal(rec_before, rec_after)


def test_a_4d_mask_is_refused(qwen):
    layer = qwen.model.layers[0].linear_attn
    with patched(qwen), pytest.raises(InvalidInputError, match="attention_mask"):
        layer(torch.zeros(1, 3, 32), attention_mask=torch.ones(1, 1, 3, 3))


def test_the_naive_backend_agrees(qwen):
    """The token-by-token reference kernels behind the patched layers give the same model outputs."""
    ids = tokens(1, 12)
    reference = forward(qwen, ids)
    with patched(qwen, backend="naive"):
        assert_close(forward(qwen, ids), reference)


def test_a_cache_recording_its_past_keeps_the_whole_conv_history(qwen):
    """While transformers records the past (assisted generation), conv states grow instead of keeping the last K;
    the patched layers still read the last K and write as transformers does."""
    ids = tokens(2, 15)
    reference = forward(qwen, ids)
    with patched(qwen):
        cache = new_cache(qwen)
        cache.activate_past_recording()
        pieces = [forward(qwen, ids[:, a:b], cache, start=a) for a, b in [(0, 6), (6, 7), (7, 15)]]
    assert_close(torch.cat(pieces, dim=1), reference)
    assert [cache.layers[i].conv_states[0].shape[-1] for i in linear_layer_indices(cache)] == [15]
    with patched(qwen):  # a first prefill shorter than the conv kernel: its recorded past is too (was refused)
        cache = new_cache(qwen)
        cache.activate_past_recording()
        pieces = [forward(qwen, ids[:, a:b], cache, start=a) for a, b in [(0, 2), (2, 3), (3, 15)]]
    assert_close(torch.cat(pieces, dim=1), reference)


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
def test_a_copy_of_a_patched_model_runs_its_own_layers_and_pickles(family):
    """The patched forward closed over the layer it patched: a deepcopy (TRL's reference model) ran the original's
    layers (logits 0.8-0.9 off its own weights, gradients into the original) and torch.save failed on a local
    function. Now the copy and an unpickled model run their own layers, patched."""
    import copy
    import io

    model, ids = patch(build(family, seed=3)), tokens(1, 12)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for param in twin.parameters():
            param.mul_(1.1)
    plain = copy.deepcopy(twin)
    unpatch(plain)
    assert is_patched(twin) and not is_patched(plain)
    assert_close(forward(twin, ids), forward(plain, ids))
    twin(input_ids=ids).logits.sum().backward()
    assert all(param.grad is None for param in model.parameters())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert is_patched(loaded)
    assert_close(forward(loaded, ids), forward(model, ids))


@pytest.mark.parametrize("per_row", [False, True])
def test_numpy_capture_offsets_record_what_python_ints_record(qwen, per_row):
    """Offsets computed with numpy (np.int64 from a placement) were refused, told to be "a list of ints" (the
    kernels take numpy integers as the ints they equal); a numpy bool is still no offset."""
    import numpy as np

    ids = tokens(2, 10)
    records = []
    for offsets in ([3, 10], [np.int64(3), np.int32(10)]):
        positions = [offsets, offsets] if per_row else offsets
        with patched(qwen):
            cache = RecordingCache(qwen, positions)
            forward(qwen, ids, cache)
        records.append(cache.records)
    assert records[0].keys() == records[1].keys() and records[0]
    for key, (conv, state) in records[0].items():
        assert torch.equal(conv, records[1][key][0]) and torch.equal(state, records[1][key][1])
        assert all(type(offset) is int for _, offset, _ in records[1])
    with patched(qwen), pytest.raises(InvalidInputError, match="ints"):
        forward(qwen, ids, RecordingCache(qwen, [np.bool_(True)]))
