"""Gated delta rule (GatedDeltaNet: Qwen3.5, Qwen3-Next, OLMo-hybrid; Kimi KDA with per-channel decay).

Per token, with state S [K, V] (decay per head, or per key channel for KDA):
    S = S * exp(g_t);   S = S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = (scale q_t)^T S
`gated_delta_rule` returns the outputs, the final state and the states at the requested positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixlab.errors import check_bool, check_scale
from prefixlab.recurrent import _checks
from prefixlab.recurrent._checks import require
from prefixlab.recurrent.delta_rule_chunked import delta_rule_chunked, delta_rule_compiled, prepare_qk
from prefixlab.recurrent.dispatch import resolve_backend, triton_dtype_unsupported

States = dict[int, torch.Tensor]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    capture: Sequence[int] = (),
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Gated delta rule over T tokens, returning states at the `capture` positions too.

    Layouts as transformers' torch fallback: q, k [B, T, Hk, K]; v [B, T, Hv, V]; beta [B, T, Hv]; g (log decay,
    <= 0) [B, T, Hv] or [B, T, Hv, K] (KDA); Hv a multiple of Hk, value head h reading key head h // (Hv // Hk).
    initial_state [B, Hv, K, V] (zeros if None). capture: sorted positions p in [0, T], p = state after the first
    p tokens of this call. scale defaults to K ** -0.5.

    Returns (o [B, T, Hv, V] in q's dtype, final state [B, Hv, K, V] float32, {p: state float32}).
    backend: "naive" (token loop), "torch" (chunked), "compiled" (chunked, torch.compile), "fla" (CUDA fp16 / bf16
    with one decay per head; always chunks of 64), or "auto" (fla where it applies and is installed, else torch).
    """
    batch, length, heads_k, dim_k, heads_v, dim_v = _check_delta_inputs(q, k, v, g, beta)
    _checks.check_state("initial_state", initial_state, (batch, heads_v, dim_k, dim_v), q.dtype)
    _checks.check_same_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state})
    positions = _checks.check_capture(capture, length)
    use_qk_l2norm = check_bool("use_qk_l2norm", use_qk_l2norm)
    chunk_size, scale = _checks.check_chunk_size(chunk_size), check_scale(scale, "K ** -0.5")
    backend = resolve_backend(backend, q.device, "fla", fla_unsupported(q.dtype, g.dim() == 4), tokens=length)

    out_dtype = q.dtype
    scale = dim_k**-0.5 if scale is None else scale
    if heads_k != heads_v:
        q, k = (x.repeat_interleave(heads_v // heads_k, dim=2) for x in (q, k))
    if initial_state is None:
        state = torch.zeros(batch, heads_v, dim_k, dim_v, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32, copy=True)  # never alias the caller's tensor

    if length == 0:
        backend = "naive"
    if backend == "fla":
        from prefixlab.recurrent.cuda import delta_rule_fla  # imported only for CUDA tensors

        o, final, captured = delta_rule_fla(q, k, v, g, beta, state, positions, use_qk_l2norm, scale)
    else:
        q, k, v, g, beta = (_checks.cast(x, torch.float32) for x in (q, k, v, g, beta))
        o, final, captured = _KERNELS[backend](q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale)
    return _checks.cast(o, out_dtype), final, captured


def _check_delta_inputs(q, k, v, g, beta) -> tuple[int, int, int, int, int, int]:
    _checks.check_tensor("q", q, (None, None, None, None))
    batch, length, heads_k, dim_k = q.shape
    _checks.check_tensor("k", k, (batch, length, heads_k, dim_k))
    _checks.check_tensor("v", v, (batch, length, None, None))
    heads_v, dim_v = v.shape[2:]
    require(heads_k > 0 and dim_k > 0, f"q has {heads_k} heads of key dim {dim_k}; both must be at least 1")
    require(
        heads_v % heads_k == 0,
        f"v has {heads_v} heads, not a multiple of q/k's {heads_k} heads (each key head serves Hv // Hk value heads)",
    )
    _checks.check_same_dtype({"q": q, "k": k, "v": v})
    require(
        isinstance(g, torch.Tensor) and g.dim() in (3, 4),
        f"g must be a tensor [B, T, Hv] or [B, T, Hv, K], got {getattr(g, 'shape', type(g).__name__)}",
    )
    _checks.check_tensor("g", g, (batch, length, heads_v) + ((dim_k,) if g.dim() == 4 else ()))
    _checks.check_tensor("beta", beta, (batch, length, heads_v))
    return batch, length, heads_k, dim_k, heads_v, dim_v


def delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    positions: tuple[int, ...],
    chunk_size: int,
    use_qk_l2norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Reference: one token at a time, on fp32 [B, T, H, *] inputs with heads expanded; g [B, T, H] or
    [B, T, H, K]. chunk_size is unused (kept for a uniform kernel signature)."""
    q, k = prepare_qk(q, k, use_qk_l2norm, scale)
    wanted = set(positions)
    captured: States = {}
    outputs = []
    # rows [B, H, 1, K] times the state [B, H, K, V]: a batched matmul (torch.einsum's Python wrapper costs as much
    # as the product itself at a decode step's size)
    q, k = q[:, :, :, None, :], k[:, :, :, None, :]
    for t in range(q.shape[1]):
        if t in wanted:
            captured[t] = state.clone()
        decay = g[:, t].exp()
        state = state * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        delta = (v[:, t, :, None, :] - k[:, t] @ state) * beta[:, t, :, None, None]
        state = state + k[:, t].transpose(-1, -2) * delta
        outputs.append(q[:, t] @ state)
    if q.shape[1] in wanted:
        captured[q.shape[1]] = state.clone()
    o = torch.cat(outputs, dim=2).transpose(1, 2) if outputs else v.new_zeros(v.shape)
    return o, state, captured


def fla_unsupported(dtype: torch.dtype, per_channel_decay: bool) -> str | None:
    """Why fla's chunk kernel cannot take these inputs (None: it can). Never float32: besides Triton's TF32 default,
    fla 0.6 computes its fused triangular solve in TF32 on sm80+ GPUs whatever TRITON_F32_DEFAULT says (a module
    constant; OLMo-hybrid's logits moved by 2e-3 with it, benchmarks/RESULTS.md, GPU session 27)."""
    if per_channel_decay:
        return "takes one decay per head, not per key channel (KDA)"
    if dtype == torch.float32:
        return ("is used for float16 / bfloat16 inputs only (fla computes float32 dot products of its triangular "
                "solve in TF32 on sm80+ GPUs)")
    return triton_dtype_unsupported(dtype)


_KERNELS = {"naive": delta_rule_naive, "torch": delta_rule_chunked, "compiled": delta_rule_compiled}
