"""Mamba2 SSD (Mamba2, Bamba, Nemotron-H, Falcon-H1, Granite-4-H, Zamba2) with states at any position.

Per token, per head, with state S [P, N] (head_dim x state size) and dt already biased / softplus'd / clamped:
    S = S * exp(dt_t A) + (dt_t x_t) B_t^T;   y_t = S C_t + D x_t
z-gating is left to the layer, as in transformers' torch path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch
import torch.nn.functional as F

from prefixlab.errors import check_bool
from prefixlab.recurrent import _checks
from prefixlab.recurrent._checks import require
from prefixlab.recurrent.dispatch import resolve_backend, triton_dtype_unsupported
from prefixlab.recurrent.ssd_chunked import ssd_chunked, ssd_compiled

States = dict[int, torch.Tensor]


def ssd_backend(backend: str, device: torch.device, dtype: torch.dtype, tokens: int) -> str:
    """The backend `ssd` runs for `tokens` inputs of `dtype` on `device` (mamba_ssm: CUDA, fp16 / bf16; fp32 under
    TRITON_F32_DEFAULT=ieee)."""
    return resolve_backend(backend, device, "mamba_ssm", triton_dtype_unsupported(dtype), tokens=tokens)


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: torch.Tensor | None = None,
    capture: Sequence[int] = (),
    chunk_size: int = 256,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Mamba2 state-space dual over T tokens, returning states at the `capture` positions too.

    Layouts as transformers' mamba2 torch path: x [B, T, H, P]; dt [B, T, H]; A [H] (negative); B, C [B, T, G, N]
    with H a multiple of G (head h reads group h // (H // G)); D [H] or [H, P]; dt_bias [H]; initial_state
    [B, H, P, N] (zeros if None). capture: sorted positions p in [0, T] (p = state after the first p tokens).

    Returns (y [B, T, H, P] in x's dtype, final state [B, H, P, N] float32, {p: state float32}).
    backend: "naive", "torch" (chunked), "compiled", "mamba_ssm" (CUDA only) or "auto".
    """
    batch, length, heads, head_dim, groups, state_size = _check_ssd_inputs(x, dt, A, B, C, D, dt_bias)
    _checks.check_state("initial_state", initial_state, (batch, heads, head_dim, state_size), x.dtype)
    _checks.check_same_device({"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias,
                               "initial_state": initial_state})  # fmt: skip
    positions = _checks.check_capture(capture, length)
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    chunk_size = _checks.check_chunk_size(chunk_size)
    require(
        isinstance(dt_limit, tuple | list) and len(dt_limit) == 2
        and all(isinstance(v, Real) and not isinstance(v, bool) and v == v for v in dt_limit)  # (v == v: not NaN)
        and dt_limit[0] <= dt_limit[1],
        f"dt_limit must be (low, high) numbers with low <= high (high may be math.inf), got {dt_limit!r}",
    )
    backend = ssd_backend(backend, x.device, x.dtype, length)
    if length == 0:
        backend = "naive"
    if backend == "mamba_ssm":
        from prefixlab.recurrent.cuda import ssd_mamba_ssm  # imported only for CUDA tensors

        return ssd_mamba_ssm(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state, positions, chunk_size)

    x32, dt, A, B, C = (_checks.cast(t, torch.float32) for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + _checks.cast(dt_bias, torch.float32)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    if groups != heads:
        B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
    if initial_state is None:
        state = torch.zeros(batch, heads, head_dim, state_size, dtype=torch.float32, device=x.device)
    else:
        state = initial_state.to(torch.float32, copy=True)  # never alias the caller's tensor
    kernel = {"naive": ssd_naive, "torch": ssd_chunked, "compiled": ssd_compiled}[backend]
    y, final, captured = kernel(x32, dt, A, B, C, state, positions, chunk_size)
    if D is not None:
        skip = _checks.cast(D, torch.float32)
        y = y + x32 * (skip[:, None] if D.dim() == 1 else skip)
    return _checks.cast(y, x.dtype), final, captured



def _check_ssd_inputs(x, dt, A, B, C, D, dt_bias) -> tuple[int, int, int, int, int, int]:
    _checks.check_tensor("x", x, (None, None, None, None))
    batch, length, heads, head_dim = x.shape
    _checks.check_tensor("dt", dt, (batch, length, heads))
    _checks.check_tensor("A", A, (heads,))
    _checks.check_tensor("B", B, (batch, length, None, None))
    groups, state_size = B.shape[2:]
    require(groups > 0 and heads % groups == 0, f"B has {groups} groups, which must divide x's {heads} heads")
    _checks.check_tensor("C", C, (batch, length, groups, state_size))
    if D is not None:  # (its shape picked by its rank: a tensor first, or a float fails on .dim())
        _checks.check_tensor("D", D, (heads,) if isinstance(D, torch.Tensor) and D.dim() == 1 else (heads, head_dim))
    if dt_bias is not None:
        _checks.check_tensor("dt_bias", dt_bias, (heads,))
    return batch, length, heads, head_dim, groups, state_size


def ssd_naive(x, dt, A, B, C, state, positions, chunk_size=0) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Reference: one token at a time, on prepared inputs (fp32; dt final; B, C expanded to heads [B, T, H, N]),
    without the D skip. chunk_size is unused (kept for a uniform kernel signature)."""
    wanted = set(positions)
    captured: States = {}
    outputs = []
    for t in range(x.shape[1]):
        if t in wanted:
            captured[t] = state.clone()
        decay = (dt[:, t] * A).exp()[..., None, None]
        write = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = state * decay + write
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    if x.shape[1] in wanted:
        captured[x.shape[1]] = state.clone()
    y = torch.stack(outputs, dim=1) if outputs else x.new_zeros(x.shape)
    return y, state, captured
