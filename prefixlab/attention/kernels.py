"""Attention that also returns the log-sum-exp of the scores, and the combine of such partial results.

Attention over a union of disjoint key sets equals the LSE-weighted sum of attention over each set:
    out = sum_i exp(lse_i - lse) * out_i,   lse = logsumexp_i(lse_i)
so Hydragen computes the shared prefix and each suffix separately and merges them with `combine_partials`.
A query that sees no key of a set gets lse = -inf there and contributes nothing.

Implementations of `attention_with_lse`, all on (N, heads, M, D) queries and (N, kv_heads, L, D) keys:
- `attention_with_lse_reference`: matmul + logsumexp, readable, any device;
- CPU: ATen's fused flash kernel, which returns the LSE (compiled FlexAttention on CPU refuses `return_lse` in
  torch 2.13, and the eager one materialises the scores);
- CUDA, by call shape (`CUDA_LSE_KERNELS`; Hydragen makes two kinds of call): "long" calls (a shared level: thousands
  of folded queries over a long prefix, compute-bound) and "short" ones (each sequence's few queries over its own
  short suffix, memory-bound), each served by one of compiled FlexAttention with `AuxRequest(lse=True)` ("flex"),
  cuDNN's or FlashAttention-2's fused kernel through ATen ("cudnn", the default for both; "flash"; no mask, equal
  head counts, 16-bit), or `attention_with_lse_matmul` ("matmul": two batched GEMMs with float32 scores, fine where
  M * L is small); calls a fused kernel cannot take go to flex (long) or matmul (short).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from prefixlab.compile import compile_or_eager
from prefixlab.errors import InvalidInputError, check_scale


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, LSEs and the combine run in float32, or in float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _expand_kv_heads(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    return x.repeat_interleave(q_heads // x.shape[1], dim=1)


def attention_with_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (N, H, M, D), lse (N, H, M), float32 or float64); `mask` (N or 1, 1, M, L) bool, True = may attend."""
    k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
    acc = accumulate_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is nan: rows that see nothing get weight 0 instead
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse


def _matmul_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) with float32 (float64) products; 16-bit CUDA inputs are not upcast in memory."""
    acc = accumulate_dtype(a.dtype)
    if a.dtype == acc:
        return torch.matmul(a, b)
    if a.is_cuda:
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=acc)
        return out.view(*lead, *out.shape[-2:])
    return torch.matmul(a.to(acc), b.to(acc))


def fold_grouped_queries(
    q: torch.Tensor, kv_heads: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GQA without expanded KV: (N, Hq, M, D) queries -> (N, Hkv, G * M, D), a KV head's G query heads along its
    query axis; a (N|1, 1, M, L) mask follows -> (N|1, 1, G * M, L)."""
    n, heads, queries, dim = q.shape
    group = heads // kv_heads
    if mask is not None:
        keys = mask.shape[-1]
        mask = mask.unsqueeze(2).expand(mask.shape[0], 1, group, queries, keys).reshape(-1, 1, group * queries, keys)
    return q.reshape(n, kv_heads, group * queries, dim), mask


def attention_with_lse_matmul(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's arithmetic without its copies: a KV head's query heads fold into its query axis (no expanded
    KV), products accumulate in float32 from 16-bit operands, probabilities meet V in V's dtype (as fused kernels do).
    Memory-bound at decode over short suffixes, where fused kernels pad a handful of queries to a 64- or 128-row tile.
    """
    n, heads, queries, _ = q.shape
    folded, mask = fold_grouped_queries(q, k.shape[1], mask)
    scores = _matmul_accumulate(folded, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see nothing: weight 0
    out = _matmul_accumulate(probs.to(v.dtype), v).to(q.dtype)
    return out.reshape(n, heads, queries, -1), lse.reshape(n, heads, queries)


def _attention_with_lse_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=additive, scale=scale)
    if mask is not None:
        # the kernel reports lse = 0 for a row that sees nothing; the combine needs -inf there
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse.to(accumulate_dtype(q.dtype))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # default (automatic) dynamic shapes: a decode loop's growing suffix recompiles once, not every step
    return compile_or_eager(flex_attention, "FlexAttention (attention with LSE)")


def _attention_with_lse_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    block_mask = None
    if mask is not None:
        dense = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[b, 0, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    gqa = q.shape[1] != k.shape[1]
    out, aux = _compiled_flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse.to(accumulate_dtype(q.dtype))


def _attention_with_lse_cudnn(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def _attention_with_lse_flash(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
    return out, lse


CUDA_LSE_KERNELS = {"flex": _attention_with_lse_flex, "cudnn": _attention_with_lse_cudnn,
                    "flash": _attention_with_lse_flash, "matmul": attention_with_lse_matmul}
FUSED = ("cudnn", "flash")
# cuDNN for both kinds: on one H200 at Hydragen's decode shapes (B = 1024, P = 16K) 0.43 ms for the level call
# (flex 0.63, FlashAttention-2 0.79) and 0.30 ms for the suffix call (flash 0.47, matmul 0.51, flex 0.61); results
# and command in benchmarks/RESULTS.md, "GPU (session 27)"
DEFAULT_CUDA_LSE_KERNELS = {"long": "cudnn", "short": "cudnn"}
# what a fused kernel cannot take (a mask, grouped heads, fp32, head dims over 128, GPUs before sm80) goes here
FALLBACK_CUDA_LSE_KERNELS = {"long": "flex", "short": "matmul"}
SHORT_CALL_SCORES = 1 << 16  # M * L per (sequence, KV head) up to which a call is "short"
_failed_fused: set[str] = set()  # fused kernels that raised in this process: not asked again


@functools.cache
def cuda_lse_kernels(setting: str | None) -> dict[str, str]:
    """Each call kind's kernel: the defaults, overridden by `PREFIXLAB_LSE_KERNELS` ("long=flex,short=matmul")."""
    chosen = dict(DEFAULT_CUDA_LSE_KERNELS)
    for item in filter(None, (setting or "").replace(" ", "").split(",")):
        kind, _, name = item.partition("=")
        if kind not in chosen or name not in CUDA_LSE_KERNELS:
            raise InvalidInputError(
                f"PREFIXLAB_LSE_KERNELS: {item!r} is not KIND=KERNEL with KIND in {sorted(chosen)} and KERNEL in "
                f"{sorted(CUDA_LSE_KERNELS)}; e.g. PREFIXLAB_LSE_KERNELS=long=flex,short=matmul, or unset it")
        chosen[kind] = name
    return chosen


def active_cuda_lse_kernels() -> dict[str, str]:
    """The kernels CUDA calls use now (benchmarks record them with their timings)."""
    return cuda_lse_kernels(os.environ.get("PREFIXLAB_LSE_KERNELS"))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cuda_lse_kernel_name(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> tuple[str, str]:
    """(call kind, kernel name) for a CUDA call: the kind's chosen kernel, or its fallback where that cannot run."""
    kind = "short" if q.shape[2] * (q.shape[1] // k.shape[1]) * k.shape[2] <= SHORT_CALL_SCORES else "long"
    name = active_cuda_lse_kernels()[kind]
    if name in FUSED and (name in _failed_fused or mask is not None or q.shape[1] != k.shape[1]
                          or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 128
                          or q.shape[-1] % 8 or _capability(q.device) < (8, 0)):
        name = FALLBACK_CUDA_LSE_KERNELS[kind]
    return kind, name


def _attention_with_lse_cuda(q, k, v, mask, scale):
    kind, name = cuda_lse_kernel_name(q, k, mask)
    try:
        return CUDA_LSE_KERNELS[name](q, k, v, mask, scale)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:  # a fused kernel refusing a shape or this GPU: its fallback, from now on
        if name not in FUSED:
            raise
        fallback = FALLBACK_CUDA_LSE_KERNELS[kind]
        warnings.warn(f"prefixlab: the {name} attention kernel failed here ({str(error)[:200]}); {fallback} serves "
                      f"its calls from now on", RuntimeWarning, stacklevel=2)
        _failed_fused.add(name)
        return CUDA_LSE_KERNELS[fallback](q, k, v, mask, scale)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out, lse): q (N, H, M, D), k/v (N, Hkv, L, D), mask (N|1, 1, M, L) bool."""
    _check_lse_inputs(q, k, v, mask)
    scale = check_scale(scale, "head_dim ** -0.5")
    if k.shape[2] == 0:
        raise InvalidInputError("attention_with_lse needs at least one key; drop empty key sets before calling")
    if q.shape[2] == 0:  # (ATen's fused CPU kernel divides by the query count: SIGFPE)
        return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=accumulate_dtype(q.dtype))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # the fused kernels read the head dim as unit-stride (ATen's CPU one without checking; SDPA checks before choosing
    # it): a transposed K cache gave silently wrong outputs
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.device.type == "cpu":
        return _attention_with_lse_cpu(q, k, v, mask, scale)
    if q.device.type == "cuda":
        return _attention_with_lse_cuda(q, k, v, mask, scale)
    return attention_with_lse_reference(q, k, v, mask, scale)


def _check_lse_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """InvalidInputError unless the shapes fit (ATen's fused CPU kernel reads out of bounds, or divides by zero,
    where they do not)."""
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        raise InvalidInputError("attention_with_lse takes 4-D tensors: q (N, H, M, D), k and v (N, Hkv, L, D)")
    (n, heads, queries, dim), (kn, kv_heads, keys, kdim) = q.shape, k.shape
    if v.shape[:3] != k.shape[:3] or kn != n or kdim != dim or kv_heads == 0 or heads % kv_heads:
        raise InvalidInputError(f"attention_with_lse: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not "
                                "fit: same N, k's and q's head dim equal, v as many keys as k, H a multiple of Hkv > 0")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise InvalidInputError(f"attention_with_lse: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                                f"{v.dtype}")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] not in (1, n)
                             or tuple(mask.shape[1:]) != (1, queries, keys)):
        raise InvalidInputError(f"attention_with_lse: mask must be bool (N|1, 1, M, L) = (.., 1, {queries}, {keys}), "
                                f"got {mask.dtype} {list(mask.shape)}")


def combine_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge K partial attentions over disjoint key sets: outs (K, ..., D), lses (K, ...) -> (..., D).

    Queries that see no key at all (every lse = -inf) get 0, as SDPA gives for fully masked rows.
    """
    lse_max = lses.amax(dim=0)
    lse_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lses - lse_max)  # exp(-inf) = 0 for sets a query does not see
    total = weights.sum(dim=0)
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    return (weights.unsqueeze(-1) * outs.to(accumulate_dtype(outs.dtype))).sum(dim=0).to(outs.dtype)


@functools.cache
def compiled_combine():
    """`combine_partials` fused into one kernel by torch.compile (used on CUDA, where launches dominate)."""
    return compile_or_eager(combine_partials, "the partial-attention combine", dynamic=True)
