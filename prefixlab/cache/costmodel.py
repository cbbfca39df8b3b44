"""Bytes and FLOPs of a hybrid LLM, per layer type: what a cached prefix costs to keep and saves to reuse.

A model is a tuple of `LayerGroup`s (`count` identical layers of one kind). Each group knows, per layer:
- `linear_flops_per_token`: FLOPs per prefilled token that do not depend on context (projections, MLP, SSM scan);
- `pair_flops`: attention FLOPs per (query, key) pair, so L tokens cost `pair_flops * L**2` (the quadratic term);
- `kv_bytes_per_token`: attention K and V bytes per cached token;
- `state_bytes`: bytes of one recurrent checkpoint (SSM / GatedDeltaNet / KDA recurrent state + conv state).

Prefilling `n_new` tokens after `n_past` cached ones costs
`linear * n_new + pair * ((n_past + n_new)**2 - n_past**2)`, so costs add up along a prefix:
`prefill_flops(a) + prefill_flops(b, a) == prefill_flops(a + b)`.

FLOP conventions follow the Marconi paper (Pan et al., MLSys 2025, Appendix A): a (m x k) @ (k x n) matmul is
`2 m k n` FLOPs, attention counts the full L x L score and value products (`4 L^2 d`, no causal halving), and the
SSM scan costs `8 d_inner N` per token (decay, discretised input, scan update, output contraction).
Layer kinds and variants of the newer families (gated heads, token indexers, hyper-connections, CCA, PLE) are in
`prefixlab.cache.costmodel_variants`; reading HF configs into layer groups in `prefixlab.cache.readers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from prefixlab.errors import InvalidInputError, UnsupportedModelError, is_finite_number, is_int

if TYPE_CHECKING:
    import torch

# An A100's 312 TFLOP/s fp16 dense peak at 50% model-FLOPs utilisation, typical of long prefills (Marconi's testbed).
DEFAULT_EFFECTIVE_FLOPS_PER_SECOND = 312e12 * 0.5

# Recurrent states stay fp32 whatever the model dtype: fla, mamba_ssm and transformers' torch paths run the scan
# in fp32 and cache its result (checked against tiny bf16 models in tests/test_costmodel_hf.py).
FP32_BYTES = 4

Tokens = int | np.ndarray  # a token count, or an integer array of them (vectorised pricing)

LAYER_KINDS = ("attention", "mamba", "mamba2", "gated_deltanet", "kda", "short_conv", "lightning", "mlp", "moe",
               "ple", "hyper_connection")
# Token ids kept as a state (Qwen4-Exp's n-gram context) are int64.
TOKEN_ID_BYTES = 8
# Dims that may be 0 (a flag, or a part the model may lack); every other dim of a group with layers must be >= 1.
OPTIONAL_DIMS = frozenset({"gated", "output_gate", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                           "shared_intermediate", "latent_size", "full_rank_gates"})


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """`count` identical layers of one `kind`; all costs are per layer. `dims` records the shape they came from
    as (name, value) pairs (hidden, heads, state size, conv kernel, experts, ...)."""

    kind: str
    count: int
    linear_flops_per_token: float
    pair_flops: float = 0.0
    kv_bytes_per_token: int = 0
    state_bytes: int = 0
    dims: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise InvalidInputError(f"LayerGroup kind={self.kind!r} is unknown; use one of {LAYER_KINDS}")
        if not is_int(self.count) or self.count < 0:
            raise InvalidInputError(f"LayerGroup count={self.count!r} must be an int >= 0")
        # costs are finite (an infinite one makes 0 x inf = NaN FLOPs), byte sizes whole (they size payloads)
        costs = {"linear_flops_per_token": is_finite_number, "pair_flops": is_finite_number,
                 "kv_bytes_per_token": is_int, "state_bytes": is_int}
        bad = [f"{name}={getattr(self, name)!r}" for name, kind in costs.items()
               if not (kind(getattr(self, name)) and getattr(self, name) >= 0)]
        if self.count:  # a group with no layers is dropped, whatever dims its (absent) layers would have
            bad += [f"{name}={value}" for name, value in self.dims if value < (name not in OPTIONAL_DIMS)]
        if bad:
            raise InvalidInputError(f"{self.kind} layers: {', '.join(bad)}; dims must be >= 1, FLOP costs finite "
                                    "numbers and byte sizes ints, both >= 0")


def attention_layers(
    count: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, gated: bool = False,
    output_size: int | None = None,
) -> LayerGroup:
    """Softmax attention (MHA/GQA). Q, K, V projections `2 h (q + 2 kv)` (+`2 h q` for a sigmoid output gate, as
    Qwen3-Next / Qwen3.5 project Q twice as wide), output projection `2 q out` (`out` = `output_size` or `h`),
    scores and values `4 q` per pair."""
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    projections = 2 * hidden * (q_dim * (2 if gated else 1) + 2 * kv_dim) + 2 * q_dim * (output_size or hidden)
    dims = dims_of(hidden=hidden, heads=num_heads, kv_heads=num_kv_heads, head_dim=head_dim, output_gate=gated)
    return LayerGroup("attention", count, projections, 4 * q_dim, 2 * kv_dim * dtype_bytes, dims=dims)


def mla_attention_layers(
    count: int, hidden: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
    kv_lora_rank: int, q_lora_rank: int | None, dtype_bytes: int,
) -> LayerGroup:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi Linear). The cache holds the latents, not per-head K/V:
    `kv_lora_rank` compressed values plus the shared `qk_rope_head_dim` RoPE key per token. Projections: Q
    (`2 h H dqk`, or through a rank-`q_lora_rank` bottleneck), kv_a `2 h (r + rope)`, kv_b expanding the latent to
    K-nope and V (`2 r H (nope + dv)`, once per token), output `2 H dv h`; scores `2 H dqk` and values `2 H dv`
    per pair, with `dqk = nope + rope`."""
    qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
    q_dim, v_dim = num_heads * qk_head_dim, num_heads * v_head_dim
    q_flops = 2 * q_lora_rank * (hidden + q_dim) if q_lora_rank else 2 * hidden * q_dim
    latent = kv_lora_rank + qk_rope_head_dim
    projections = (q_flops + 2 * hidden * latent + 2 * kv_lora_rank * num_heads * (qk_nope_head_dim + v_head_dim)
                   + 2 * v_dim * hidden)
    dims = dims_of(hidden=hidden, heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                 v_head_dim=v_head_dim, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank or 0)
    return LayerGroup("attention", count, projections, 2 * (q_dim + v_dim), latent * dtype_bytes, dims=dims)


def dims_of(**dims: int) -> tuple[tuple[str, int], ...]:
    return tuple((name, int(value)) for name, value in dims.items())


def mlp_layers(count: int, hidden: int, intermediate: int, gated: bool = True) -> LayerGroup:
    """Dense MLP: up (+ gate for SwiGLU) and down projections, `2 h i` each."""
    dims = dims_of(hidden=hidden, intermediate=intermediate, gated=gated)
    return LayerGroup("mlp", count, 2 * hidden * intermediate * (3 if gated else 2), dims=dims)


def moe_layers(
    count: int,
    hidden: int,
    expert_intermediate: int,
    num_experts: int,
    top_k: int,
    shared_intermediate: int = 0,
    gated: bool = True,
    shared_expert_gate: bool = False,
    latent_size: int | None = None,
) -> LayerGroup:
    """Mixture of experts: router `2 h E` (+`2 h` for Qwen's sigmoid gate on the shared expert), `top_k` routed
    expert MLPs and an always-on shared MLP per token. With `latent_size` (Nemotron-H) the routed experts work
    on a latent of that width, projected from and back to `h` (`4 h latent`)."""
    matrices = 3 if gated else 2
    expert_width = latent_size or hidden
    flops = (
        2 * hidden * (num_experts + shared_expert_gate)
        + 2 * matrices * (expert_width * top_k * expert_intermediate + hidden * shared_intermediate)
        + (4 * hidden * latent_size if latent_size else 0)
    )
    dims = dims_of(hidden=hidden, expert_intermediate=expert_intermediate, experts=num_experts, top_k=top_k,
                 shared_intermediate=shared_intermediate, gated=gated, latent_size=latent_size or 0)
    return LayerGroup("moe", count, flops, dims=dims)


def _ssm_layers(
    kind: str, count: int, hidden: int, d_inner: int, in_proj_width: int, conv_dim: int, conv_kernel: int,
    state_elems: int, scan_flops: int, dtype_bytes: int, state_dtype_bytes: int, dims: tuple = (),
) -> LayerGroup:
    """Shared shape of every recurrent mixer: in_proj, depthwise causal conv, scan, out_proj. The conv state holds
    `conv_kernel` columns in the model dtype; the recurrent state has its own dtype."""
    flops = 2 * hidden * in_proj_width + 2 * conv_dim * conv_kernel + scan_flops + 2 * d_inner * hidden
    state_bytes = state_elems * state_dtype_bytes + conv_dim * conv_kernel * dtype_bytes
    return LayerGroup(kind, count, flops, state_bytes=state_bytes, dims=dims)


def mamba2_layers(
    count: int, hidden: int, num_heads: int, head_dim: int, state_size: int, n_groups: int, conv_kernel: int,
    dtype_bytes: int, state_dtype_bytes: int = FP32_BYTES,
) -> LayerGroup:
    """Mamba2 (SSD): in_proj emits z, x, B, C (`2 G N`) and dt (`H`); conv runs over x, B, C;
    the state holds `H * P * N` values and the conv state `conv_kernel` columns of x, B, C."""
    d_inner = num_heads * head_dim
    conv_dim = d_inner + 2 * n_groups * state_size
    return _ssm_layers(
        "mamba2", count, hidden, d_inner, d_inner + conv_dim + num_heads, conv_dim, conv_kernel,
        d_inner * state_size, 8 * d_inner * state_size, dtype_bytes, state_dtype_bytes,
        dims_of(hidden=hidden, heads=num_heads, head_dim=head_dim, state_size=state_size, groups=n_groups,
              conv_kernel=conv_kernel),
    )


def mamba_layers(
    count: int, hidden: int, d_inner: int, state_size: int, dt_rank: int, conv_kernel: int, dtype_bytes: int,
    state_dtype_bytes: int = FP32_BYTES,
) -> LayerGroup:
    """Mamba1 (selective scan, Jamba, Zamba): in_proj emits x and z, x_proj emits dt (rank r), B, C, dt_proj expands dt;
    the conv runs over x only and the state is `d_inner * N`."""
    layers = _ssm_layers(
        "mamba", count, hidden, d_inner, 2 * d_inner, d_inner, conv_kernel, d_inner * state_size,
        8 * d_inner * state_size, dtype_bytes, state_dtype_bytes,
        dims_of(hidden=hidden, d_inner=d_inner, state_size=state_size, dt_rank=dt_rank, conv_kernel=conv_kernel),
    )
    selective = 2 * d_inner * (dt_rank + 2 * state_size) + 2 * dt_rank * d_inner
    return replace(layers, linear_flops_per_token=layers.linear_flops_per_token + selective)


def _delta_rule_layers(
    kind: str, count: int, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
    gate_width: int, conv_kernel: int, dtype_bytes: int, state_dtype_bytes: int, dims: tuple,
) -> LayerGroup:
    """Shared shape of the delta-rule mixers: q, k (`Hk dk` each) and v (`Hv dv`) go through the short conv; the
    in_proj emits `gate_width` more outputs (gates, beta); the state is `Hv * dk * dv`, costing `8` FLOPs per
    element per token (decay, S^T k, rank-1 update, q^T S)."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    conv_dim = 2 * key_dim + value_dim
    state_elems = num_v_heads * head_k_dim * head_v_dim
    return _ssm_layers(
        kind, count, hidden, value_dim, conv_dim + gate_width, conv_dim, conv_kernel, state_elems, 8 * state_elems,
        dtype_bytes, state_dtype_bytes, dims,
    )


def gated_deltanet_layers(
    count: int, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int,
    dtype_bytes: int, state_dtype_bytes: int = FP32_BYTES,
) -> LayerGroup:
    """GatedDeltaNet (Qwen3-Next / Qwen3.5, OLMo Hybrid): besides q, k, v the in_proj emits the output gate z
    (`Hv dv`) and the gates b, a (one per value head)."""
    return _delta_rule_layers(
        "gated_deltanet", count, hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
        num_v_heads * head_v_dim + 2 * num_v_heads, conv_kernel, dtype_bytes, state_dtype_bytes,
        dims_of(hidden=hidden, k_heads=num_k_heads, v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
              conv_kernel=conv_kernel),
    )


def kda_layers(
    count: int, hidden: int, num_heads: int, head_dim: int, conv_kernel: int, dtype_bytes: int,
    state_dtype_bytes: int = FP32_BYTES, full_rank_gates: bool = False,
) -> LayerGroup:
    """Kimi Delta Attention (Kimi Linear, Ling): a delta rule with per-channel decay, `H` heads of width `d` for q, k
    and v alike. Besides q, k, v the in_proj emits beta (one per head); the forget gate and the output gate are
    low-rank in Kimi, `h -> d -> H d` each (`2 h d + 2 d H d`), or `full_rank_gates` (Ling), `h -> H d` each."""
    gate_inner = num_heads * head_dim if full_rank_gates else head_dim
    layers = _delta_rule_layers(
        "kda", count, hidden, num_heads, num_heads, head_dim, head_dim, num_heads + 2 * gate_inner, conv_kernel,
        dtype_bytes, state_dtype_bytes,
        dims_of(hidden=hidden, heads=num_heads, head_dim=head_dim, conv_kernel=conv_kernel,
              full_rank_gates=full_rank_gates),
    )
    gate_up_projections = 0 if full_rank_gates else 2 * 2 * head_dim * num_heads * head_dim
    return replace(layers, linear_flops_per_token=layers.linear_flops_per_token + gate_up_projections)


def short_conv_layers(count: int, hidden: int, conv_kernel: int, dtype_bytes: int) -> LayerGroup:
    """LFM2 / LFM2-MoE / LFM3 gated short convolution: in_proj to B, C, x (`3 h`), depthwise conv over `h`
    channels, out_proj."""
    return _ssm_layers(
        "short_conv", count, hidden, hidden, 3 * hidden, hidden, conv_kernel, 0, 2 * hidden, dtype_bytes, dtype_bytes,
        dims_of(hidden=hidden, conv_kernel=conv_kernel),
    )


@dataclass(frozen=True)
class ModelSpec:
    """Bytes and FLOPs of one model, by layer group. Build with `from_name` or `from_config`.

    `kv_bytes_per_token` (all attention layers, K and V) and `state_bytes` (one recurrent checkpoint across all
    recurrent layers, recurrent + conv state) are exact byte counts; FLOPs follow the module docstring.
    `reuse_limit`: the tokens of a sequence a store may hold and reuse (GLM-5-Next's DSA selection limit,
    hfspec.selection_limit; None: all), which replays honour as a PrefixStore does.
    """

    name: str
    hidden_size: int
    dtype_bytes: int
    layers: tuple[LayerGroup, ...]
    effective_flops_per_second: float = DEFAULT_EFFECTIVE_FLOPS_PER_SECOND
    reuse_limit: int | None = None
    kv_bytes_per_token: int = field(init=False)
    state_bytes: int = field(init=False)
    linear_flops_per_token: float = field(init=False)
    pair_flops: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidInputError(f"ModelSpec {self.name!r} has no layers; pass at least one LayerGroup")
        if not all(is_int(size) and size >= 1 for size in (self.hidden_size, self.dtype_bytes)):
            raise InvalidInputError(
                f"ModelSpec {self.name!r}: hidden_size={self.hidden_size!r} and dtype_bytes={self.dtype_bytes!r} "
                "must both be ints >= 1"
            )
        if not is_finite_number(self.effective_flops_per_second) or self.effective_flops_per_second <= 0:
            raise InvalidInputError(  # (NaN made every TTFT NaN, inf every TTFT 0)
                f"effective_flops_per_second={self.effective_flops_per_second!r} must be a finite number > 0 (FLOP/s "
                "of prefill)"
            )
        if self.reuse_limit is not None and (not is_int(self.reuse_limit) or self.reuse_limit < 0):
            raise InvalidInputError(f"reuse_limit={self.reuse_limit!r} must be None (no limit) or an int >= 0 (the "
                                    "tokens of a sequence a store may hold)")
        totals = {
            "kv_bytes_per_token": sum(g.count * g.kv_bytes_per_token for g in self.layers),
            "state_bytes": sum(g.count * g.state_bytes for g in self.layers),
            "linear_flops_per_token": float(sum(g.count * g.linear_flops_per_token for g in self.layers)),
            "pair_flops": float(sum(g.count * g.pair_flops for g in self.layers)),
        }
        for name, value in totals.items():
            # (finite layers whose sum is not: every FLOP count and price inf or NaN; bytes past int64 likewise)
            if not (value < 2**63 if isinstance(value, int) else math.isfinite(value)):
                raise InvalidInputError(f"ModelSpec {self.name!r}: {name} sums to {value} over its layers; pass "
                                        "per-layer costs whose total is a finite float")
            object.__setattr__(self, name, value)

    def layer_count(self, kind: str) -> int:
        """Number of layers of `kind` (one of LAYER_KINDS)."""
        if kind not in LAYER_KINDS:
            raise InvalidInputError(f"kind={kind!r} is unknown; use one of {LAYER_KINDS}")
        return sum(g.count for g in self.layers if g.kind == kind)

    def prefill_flops(self, n_new: Tokens, n_past: Tokens = 0) -> float | np.ndarray:
        """FLOPs to prefill `n_new` tokens after `n_past` cached ones. Ints give a float; integer numpy arrays
        (broadcast together) give a float64 array, so a simulator can price many requests at once."""
        new, past = _tokens("n_new", n_new), _tokens("n_past", n_past)
        flops = self.linear_flops_per_token * new + self.pair_flops * new * (2.0 * past + new)
        return flops if isinstance(flops, np.ndarray) else float(flops)

    def flops_saved(self, hit_tokens: Tokens) -> float | np.ndarray:
        """FLOPs a hit of `hit_tokens` tokens avoids: the prefill of that prefix from scratch."""
        return self.prefill_flops(hit_tokens)

    def entry_bytes(self, n_tokens: Tokens) -> float | np.ndarray:
        """Bytes of a cached prefix of `n_tokens` tokens with one recurrent checkpoint at its end."""
        return self.state_bytes + self.kv_bytes_per_token * _tokens("n_tokens", n_tokens)

    def flop_efficiency(self, n_tokens: Tokens) -> float | np.ndarray:
        """Marconi's FLOP efficiency: FLOPs saved by reusing an `n_tokens` prefix per byte it occupies."""
        return self.flops_saved(n_tokens) / self.entry_bytes(n_tokens)

    def prefill_seconds(self, n_new: Tokens, n_past: Tokens = 0) -> float | np.ndarray:
        """Modeled prefill time: `prefill_flops / effective_flops_per_second` (compute-bound prefill)."""
        return self.prefill_flops(n_new, n_past) / self.effective_flops_per_second

    @classmethod
    def from_name(cls, name: str) -> ModelSpec:
        """A built-in spec: "marconi-7b" (the Marconi paper's 7B Mamba2 hybrid)."""
        builders = {"marconi-7b": _marconi_7b}
        if name not in builders:
            raise UnsupportedModelError(f"unknown model name {name!r}; built-in names are {sorted(builders)}")
        return builders[name]()

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | str | None = None) -> ModelSpec:
        """Spec of a transformers config (`prefixlab.cache.hfspec.SUPPORTED_MODEL_TYPES`). `dtype` (torch dtype or
        name) overrides `config.dtype`; with neither, torch's default dtype is used, as `from_config` builds."""
        from prefixlab.cache.hfspec import spec_from_config  # hfspec imports this module

        return spec_from_config(config, dtype)


def _tokens(arg: str, value: Tokens) -> float | np.ndarray:
    """Validate a token count (int >= 0 or an integer array of them) and return it as float / float64 array."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise InvalidInputError(f"{arg} must be an integer array, got dtype {value.dtype}")
        if value.size and value.min() < 0:
            raise InvalidInputError(f"{arg} has negative entries (min {value.min()}); token counts are >= 0")
        return value.astype(np.float64)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{arg} must be an int token count, got {type(value).__name__}")
    if value < 0:
        raise InvalidInputError(f"{arg}={value} is negative; token counts are >= 0")
    return float(value)


def _marconi_7b() -> ModelSpec:
    """The 7B hybrid of Marconi's evaluation: 24 Mamba2 + 4 attention + 28 MLP layers, d=4096, N=128, fp16.

    Reproduces the paper's accounting exactly (Appendix A; the public simulator's utils, camera-ready version),
    which is coarser than `mamba2_layers`:
    - attention `8 L d^2 + 4 L^2 d` (MHA, q = kv = d), KV `2 d` fp16 values per token;
    - MLP `16 L d^2` (two matrices, intermediate 4d);
    - Mamba `12 L d^2 + 16 L d N + 10 L d` (in/out projections with expand 2, scan, elementwise; the B, C, dt
      projections and the conv are left out);
    - SSM state `d * N` values plus a conv state of `(expand d + 2 N) * conv_kernel` values, fp16.
    """
    d, n, expand, conv_kernel, dtype_bytes = 4096, 128, 2, 4, 2
    mamba = LayerGroup(
        "mamba2", 24, 12 * d * d + 16 * d * n + 10 * d,
        state_bytes=(d * n + (expand * d + 2 * n) * conv_kernel) * dtype_bytes,
        dims=dims_of(hidden=d, state_size=n, expand=expand, conv_kernel=conv_kernel),
    )
    attention = attention_layers(4, d, num_heads=32, num_kv_heads=32, head_dim=128, dtype_bytes=dtype_bytes)
    mlp = mlp_layers(28, d, 4 * d, gated=False)
    return ModelSpec("marconi-7b", d, dtype_bytes, (mamba, attention, mlp))
