"""selective_scan (Mamba1 / Jamba): transformers' torch path, exact states at any position, resume == full run."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import selective_scan
from prefixlab.recurrent.hf_reference import hf_mamba_selective_scan

PER_TOKEN = ("u", "delta", "B", "C", "z")


def scan_inputs(length: int, seed: int = 0, channels: int = 6, state_size: int = 4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "u": torch.randn(2, channels, length, generator=gen),
        "delta": torch.randn(2, channels, length, generator=gen),
        "A": -torch.rand(channels, state_size, generator=gen) * 4,
        "B": torch.randn(2, state_size, length, generator=gen),
        "C": torch.randn(2, state_size, length, generator=gen),
        "D": torch.randn(channels, generator=gen),
        "z": torch.randn(2, channels, length, generator=gen),
        "delta_bias": torch.randn(channels, generator=gen) * 0.1,
    }


def tokens(inputs: dict, start: int, stop: int) -> dict:
    return {name: t[..., start:stop] if name in PER_TOKEN else t for name, t in inputs.items()}


def test_matches_transformers_jamba_selective_scan():
    inputs = scan_inputs(13)
    y_ref, state_ref = hf_mamba_selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"],
                                               D=inputs["D"], z=inputs["z"], delta_bias=inputs["delta_bias"],
                                               delta_softplus=True, return_last_state=True)  # fmt: skip
    y, state, _ = selective_scan(**inputs, delta_softplus=True)
    assert (y - y_ref).abs().max() <= 1e-5 and (state - state_ref).abs().max() <= 1e-5


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 12), with_state=st.booleans(), data=st.data())
def test_captured_states_are_prefix_final_states_and_resume_exactly(length, with_state, data):
    inputs = scan_inputs(length, seed=length)
    initial = torch.randn(2, 6, 4) if with_state else None
    positions = tuple(sorted(data.draw(st.sets(st.integers(0, length), max_size=4))))
    y, final, captured = selective_scan(**inputs, delta_softplus=True, initial_state=initial, capture=positions)
    assert sorted(captured) == list(positions)
    for p, state in captured.items():
        _, prefix_final, _ = selective_scan(**tokens(inputs, 0, p), delta_softplus=True, initial_state=initial)
        assert (state - prefix_final).abs().max() <= 1e-5
        y_tail, final_tail, _ = selective_scan(**tokens(inputs, p, length), delta_softplus=True, initial_state=state)
        assert torch.allclose(y_tail, y[..., p:], rtol=0.0, atol=1e-5) and torch.allclose(final_tail, final, atol=1e-5)


@pytest.mark.parametrize(
    "overrides,argument",
    [
        ({"A": torch.zeros(5, 4)}, "A"),
        ({"B": torch.zeros(2, 3, 5)}, "B"),
        ({"z": torch.zeros(2, 6, 4)}, "z"),
        ({"capture": (6,)}, "capture"),
        ({"initial_state": torch.zeros(2, 6, 5)}, "initial_state"),
        ({"backend": "fla"}, "backend"),
        ({"delta_softplus": "no"}, "delta_softplus must be True or False"),  # (a truthy string: softplus applied)
    ],
)
def test_rejects_bad_input(overrides, argument):
    with pytest.raises(InvalidInputError, match=argument):
        selective_scan(**{**scan_inputs(5), **overrides})
