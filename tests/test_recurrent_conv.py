"""causal_conv1d / conv_state_at: transformers' conv outputs, and resuming from a captured conv state is exact."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import causal_conv1d, conv_state_at
from prefixlab.recurrent.hf_reference import hf_causal_conv1d_fn


def conv_inputs(channels: int, length: int, kernel_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, channels, length, generator=gen),
        torch.randn(channels, kernel_size, generator=gen),
        torch.randn(channels, generator=gen),
    )


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("length", [1, 3, 17])
def test_matches_transformers_causal_conv1d_fn(activation, length):
    x, weight, bias = conv_inputs(6, length, 4)
    y, _, _ = causal_conv1d(x, weight, bias, activation)
    assert (y - hf_causal_conv1d_fn(x, weight, bias, activation)).abs().max() <= 1e-6


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(1, 12),
    kernel_size=st.integers(1, 5),
    with_state=st.booleans(),
    data=st.data(),
)
def test_resuming_from_captured_conv_state_reproduces_the_full_run(length, kernel_size, with_state, data):
    x, weight, bias = conv_inputs(3, length, kernel_size, seed=length)
    initial = torch.randn(2, 3, kernel_size) if with_state else None
    positions = tuple(sorted(data.draw(st.sets(st.integers(0, length), max_size=4))))
    y, final, captured = causal_conv1d(x, weight, bias, "silu", initial_conv_state=initial, capture=positions)
    assert sorted(captured) == list(positions)
    for p, state in captured.items():
        assert state.shape == (2, 3, kernel_size)
        assert torch.equal(state, conv_state_at(x, p, kernel_size, initial_conv_state=initial))
        y_tail, final_tail, _ = causal_conv1d(x[..., p:], weight, bias, "silu", initial_conv_state=state)
        assert torch.allclose(y_tail, y[..., p:], rtol=0.0, atol=1e-6)
        assert torch.equal(final_tail, final)


def test_conv_state_is_the_last_inputs_zero_padded_on_the_left():
    x = torch.arange(1.0, 6.0).reshape(1, 1, 5)
    assert conv_state_at(x, 2, 4).flatten().tolist() == [0.0, 0.0, 1.0, 2.0]
    assert conv_state_at(x, 5, 4).flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    history = torch.tensor([[[7.0, 8.0, 9.0, 10.0]]])
    assert conv_state_at(x, 1, 4, initial_conv_state=history).flatten().tolist() == [8.0, 9.0, 10.0, 1.0]
    assert torch.equal(conv_state_at(x, 0, 4, initial_conv_state=history), history)


def test_final_state_matches_transformers_cache_layout_after_prefill():
    # transformers' cache keeps the last kernel_size pre-conv inputs, left-padded with zeros: [B, C, K].
    x, weight, bias = conv_inputs(4, 2, 4)
    _, final, _ = causal_conv1d(x, weight, bias)
    assert torch.equal(final, torch.nn.functional.pad(x, (2, 0)))


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"pos": 6}, "pos"),
        ({"pos": -1}, "pos"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"kernel_size": True}, "kernel_size"),
        ({"initial_conv_state": torch.zeros(2, 3, 3)}, "initial_conv_state"),
    ],
)
def test_conv_state_at_rejects_bad_input(kwargs, argument):
    x = torch.zeros(2, 3, 5)
    call = {"pos": 2, "kernel_size": 4, **kwargs}
    with pytest.raises(InvalidInputError, match=argument):
        conv_state_at(x, **call)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"weight": torch.zeros(4, 4)}, "weight"),
        ({"bias": torch.zeros(2)}, "bias"),
        ({"activation": "nope"}, "activation"),
        ({"activation": ["silu"]}, "activation"),  # (TypeError: unhashable type: 'list')
        ({"capture": (3, 1)}, "capture"),
        ({"initial_conv_state": torch.zeros(1, 3, 4)}, "initial_conv_state"),
        ({"x": torch.zeros(3, 5)}, "x has shape"),  # (the weight was blamed)
        ({"bias": torch.zeros(3, dtype=torch.bfloat16)}, "bias has dtype"),  # (conv1d's own RuntimeError)
    ],
)
def test_causal_conv1d_rejects_bad_input(kwargs, argument):
    call = {"x": torch.zeros(2, 3, 5), "weight": torch.zeros(3, 4), "bias": None, **kwargs}
    with pytest.raises(InvalidInputError, match=argument):
        causal_conv1d(**call)


def test_conv_state_at_takes_a_numpy_kernel_size():
    import numpy as np

    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(conv_state_at(x, 3, np.int64(4)), conv_state_at(x, 3, 4))
