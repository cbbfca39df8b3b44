"""Mamba1 selective scan (Jamba, Mamba, Falcon-Mamba) with states at any position: a sequential reference.

Per token, per channel d, with state S [D, N] and delta already biased / softplus'd:
    S = S * exp(delta_t A) + (delta_t u_t) B_t^T;   y_t = S C_t + D u_t;   y_t *= silu(z_t) if z is given
Layouts are mamba_ssm's selective_scan_fn (channels before time), as transformers' Mamba / Jamba layers call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefixlab.errors import check_bool
from prefixlab.recurrent import _checks
from prefixlab.recurrent._checks import require
from prefixlab.recurrent.dispatch import PORTABLE_BACKENDS


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    capture: Sequence[int] = (),
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Selective scan over L tokens, returning states at the `capture` positions too.

    u, delta, z [B, D, L]; A [D, N]; B, C [B, N, L]; D, delta_bias [D]; initial_state [B, D, N] (zeros if None).
    Returns (y [B, D, L] in u's dtype, final state [B, D, N] float32, {p: state float32}).
    Every backend name ("auto", "naive", "torch", "compiled") runs the same token loop: there is no chunked Mamba1
    kernel yet (the names are accepted so that callers can pass one backend to every kernel).
    """
    _checks.check_tensor("u", u, (None, None, None))
    batch, channels, length = u.shape
    _checks.check_tensor("delta", delta, (batch, channels, length))
    _checks.check_tensor("A", A, (channels, None))
    state_size = A.shape[1]
    for name, tensor in (("B", B), ("C", C)):
        _checks.check_tensor(name, tensor, (batch, state_size, length))
    for name, tensor, shape in (("D", D, (channels,)), ("z", z, (batch, channels, length)),
                                ("delta_bias", delta_bias, (channels,))):  # fmt: skip
        if tensor is not None:
            _checks.check_tensor(name, tensor, shape)
    _checks.check_state("initial_state", initial_state, (batch, channels, state_size), u.dtype)
    _checks.check_same_device({"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z,
                               "delta_bias": delta_bias, "initial_state": initial_state})  # fmt: skip
    positions = _checks.check_capture(capture, length)
    delta_softplus = check_bool("delta_softplus", delta_softplus)
    allowed = ("auto", *PORTABLE_BACKENDS)
    require(backend in allowed, f"backend must be one of {list(allowed)}, got {backend!r}")

    delta = delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    state = (
        u.new_zeros(batch, channels, state_size, dtype=torch.float32)
        if initial_state is None
        else initial_state.to(torch.float32, copy=True)
    )
    y, state, captured = _scan(u.float(), delta, A.float(), B.float(), C.float(), state, positions)
    if D is not None:
        y = y + u.float() * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), state, captured


def _scan(u, delta, A, B, C, state, positions):
    wanted = set(positions)
    captured = {}
    outputs = []
    for t in range(u.shape[-1]):
        if t in wanted:
            captured[t] = state.clone()
        decay = torch.exp(delta[:, :, t, None] * A)
        state = state * decay + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        outputs.append(torch.einsum("bdn,bn->bd", state, C[:, :, t]))
    if u.shape[-1] in wanted:
        captured[u.shape[-1]] = state.clone()
    y = torch.stack(outputs, dim=-1) if outputs else u.new_zeros(u.shape)
    return y, state, captured
