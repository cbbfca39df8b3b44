"""Depthwise causal conv1d (the short conv before GatedDeltaNet / Mamba2 mixers) with conv states at any position.

A conv state is what transformers' linear-attention cache holds: the last kernel_size pre-conv inputs, [B, C, K]
(oldest first), zeros before the first token. Resuming from the state at p over x[..., p:] reproduces the outputs of
a run over all of x.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from prefixlab.errors import is_int
from prefixlab.recurrent import _checks
from prefixlab.recurrent._checks import require


def _with_history(x: torch.Tensor, kernel_size: int, initial_conv_state: torch.Tensor | None) -> torch.Tensor:
    """[B, C, K + T]: the K inputs before this call (the state, or zeros) followed by x."""
    if initial_conv_state is None:
        return F.pad(x, (kernel_size, 0))
    return torch.cat([initial_conv_state.to(x.dtype), x], dim=-1)


def _check_conv_inputs(x: torch.Tensor, kernel_size: int, initial_conv_state: torch.Tensor | None) -> int:
    _checks.check_tensor("x", x, (None, None, None))
    require(
        is_int(kernel_size) and kernel_size > 0,
        f"kernel_size must be a positive int, got {kernel_size!r}",
    )
    if initial_conv_state is not None:
        _checks.check_tensor("initial_conv_state", initial_conv_state, (x.shape[0], x.shape[1], kernel_size))
        _checks.check_same_device({"x": x, "initial_conv_state": initial_conv_state})
    return int(kernel_size)


def conv_state_at(
    x: torch.Tensor, pos: int, kernel_size: int, initial_conv_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Conv state after the first `pos` tokens of x [B, C, T]: inputs pos-K .. pos-1, [B, C, K], a fresh tensor."""
    kernel_size = _check_conv_inputs(x, kernel_size, initial_conv_state)
    (pos,) = _checks.check_capture((pos,), x.shape[-1], name="pos")
    return _with_history(x, kernel_size, initial_conv_state)[..., pos : pos + kernel_size].clone()


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_conv_state: torch.Tensor | None = None,
    capture: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Depthwise causal conv over x [B, C, T] with weight [C, K] (an nn.Conv1d weight squeezed) and bias [C].

    Starts from initial_conv_state [B, C, K] when given (else zero history), like transformers' causal_conv1d_fn /
    causal_conv1d_update. Computes in weight's dtype, returns y [B, C, T] in x's dtype, the final conv state and
    {p: conv state after p tokens} for the `capture` positions (all in x's dtype).
    """
    _checks.check_tensor("x", x, (None, None, None))  # (first: a 2-D x must not be blamed on the weight)
    _checks.check_tensor("weight", weight, (x.shape[1], None))
    _check_conv_inputs(x, weight.shape[1], initial_conv_state)
    if bias is not None:
        _checks.check_tensor("bias", bias, (x.shape[1],))
        require(bias.dtype == weight.dtype, f"bias has dtype {bias.dtype} and weight {weight.dtype}: give both one")
    _checks.check_same_device({"x": x, "weight": weight, "bias": bias})
    require(activation is None or (isinstance(activation, str) and activation in ACT2FN),  # (a list is unhashable)
            f"activation {activation!r} is not the name of a transformers activation")
    positions = _checks.check_capture(capture, x.shape[-1])
    y, history, states = conv_with_history(x, weight, bias, activation, initial_conv_state, positions)
    return y, history[..., -weight.shape[1]:].clone(), states


def conv_with_history(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    initial_conv_state: torch.Tensor | None, positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """causal_conv1d's computation on checked inputs: (y, the history [B, C, K + T]: the K inputs before x, then x,
    {p: conv state after p tokens}). For callers that built the inputs themselves (a patched layer's forward, each
    decode step: the checks and the final state's copy are its overhead there)."""
    kernel_size = weight.shape[1]
    history = _with_history(x, kernel_size, initial_conv_state)
    # The first output reads inputs 1 .. K of `history` (input 0 only matters to the state), hence [..., 1:].
    if x.shape[-1] == 0:  # conv1d rejects inputs shorter than the kernel
        y = x.new_empty(x.shape, dtype=weight.dtype)
    else:
        y = F.conv1d(history[..., 1:].to(weight.dtype), weight[:, None, :], bias, groups=x.shape[1])
    if activation is not None:
        y = _activation(activation)(y)
    states = {p: history[..., p : p + kernel_size].clone() for p in positions}
    return y.to(x.dtype), history, states


@functools.cache
def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' activation module of that name, built once (ACT2FN builds a new module at each lookup)."""
    return ACT2FN[name]
