"""What prefixlab knows per transformers model_type (MODEL_FAMILIES, the one table a new family is added to), and
`ModelSpec` from a transformers (5.x) config: which layers a hybrid model has and their dims.

Each reader mirrors the model's modeling file in transformers/models/<name>/: the layer pattern
(`layer_types`, `layers_block_type`, `mlp_layer_types`, periods/offsets), head and state dims, conv kernels, MoE
expert counts. KV-only decoders (DENSE_MODEL_TYPES) share one generic reader.
Byte counts are exact (tests compare them with a tiny model's cache tensors); FLOPs use `costmodel`'s formulas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from prefixlab.cache import costmodel as cm
from prefixlab.errors import InvalidInputError, UnsupportedModelError

ATTENTION_TYPES = ("full_attention", "attention", "sliding_attention")


def _dtype_bytes(config, dtype: torch.dtype | str | None) -> int:
    """Bytes per element: explicit `dtype`, else `config.dtype`, else torch's default (what from_config builds)."""
    chosen = dtype if dtype is not None else getattr(config, "dtype", None)
    if chosen is None:
        chosen = torch.get_default_dtype()
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen.removeprefix("torch."), None)
    if not isinstance(chosen, torch.dtype):
        raise InvalidInputError(f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.bfloat16 or 'bfloat16'")
    return chosen.itemsize


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _attention(c, count: int, dtype_bytes: int, gated: bool = False) -> cm.LayerGroup:
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return cm.attention_layers(count, c.hidden_size, c.num_attention_heads, kv_heads, _head_dim(c), dtype_bytes, gated)


def _count_attention(layer_types) -> int:
    return sum(t in ATTENTION_TYPES for t in layer_types)


def _refuse_windowed(c, windowed: list[str], what_to_do: str) -> None:
    """UnsupportedModelError for layers that keep a bounded KV window (their per-token bytes are not a constant)."""
    if windowed:
        raise UnsupportedModelError(
            f"{c.model_type}: layer types {sorted(set(windowed))} keep a bounded KV window, which the cost model does "
            f"not price; {what_to_do}"
        )


def _gdn_and_attention(c, dtype_bytes: int, gated: bool) -> tuple[cm.LayerGroup, ...]:
    """GatedDeltaNet ("linear_attention") + full attention layers, from the `linear_*` config names."""
    n_attention = _count_attention(c.layer_types)
    gdn = cm.gated_deltanet_layers(
        len(c.layer_types) - n_attention, c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
        c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim, dtype_bytes,
    )
    return gdn, _attention(c, n_attention, dtype_bytes, gated)


def _qwen_gdn(c, dtype_bytes: int) -> tuple[cm.LayerGroup, ...]:
    """Qwen3-Next / Qwen3.5: GatedDeltaNet + full attention with a sigmoid output gate."""
    return _gdn_and_attention(c, dtype_bytes, gated=True)


def _qwen_moe(c, count: int) -> cm.LayerGroup:
    return cm.moe_layers(count, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                         c.shared_expert_intermediate_size, shared_expert_gate=True)


def _qwen3_5(c, dtype_bytes):
    return (*_qwen_gdn(c, dtype_bytes), cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size))


def _qwen3_5_moe(c, dtype_bytes):
    return (*_qwen_gdn(c, dtype_bytes), _qwen_moe(c, c.num_hidden_layers))


def _qwen3_next(c, dtype_bytes):
    sparse = [
        i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        for i in range(c.num_hidden_layers)
    ]
    dense = cm.mlp_layers(sparse.count(False), c.hidden_size, c.intermediate_size)
    return (*_qwen_gdn(c, dtype_bytes), _qwen_moe(c, sum(sparse)), dense)


def _mamba2(count: int, c, heads: int, head_dim: int, state: int, groups: int, conv: int, dtype_bytes: int):
    return cm.mamba2_layers(count, c.hidden_size, heads, head_dim, state, groups, conv, dtype_bytes)


def _mamba2_model(c, dtype_bytes):
    return (_mamba2(c.num_hidden_layers, c, c.num_heads, c.head_dim, c.state_size, c.n_groups, c.conv_kernel,
                    dtype_bytes),)


def _bamba_style_mamba(c, count: int, dtype_bytes: int) -> cm.LayerGroup:
    """Bamba, Falcon-H1 and Granite-4-H share the `mamba_*` config names."""
    return _mamba2(count, c, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups, c.mamba_d_conv,
                   dtype_bytes)


def _bamba(c, dtype_bytes):
    n_attention = _count_attention(c.layers_block_type)
    return (
        _bamba_style_mamba(c, c.num_hidden_layers - n_attention, dtype_bytes),
        _attention(c, n_attention, dtype_bytes),
        cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size),
    )


def _falcon_h1(c, dtype_bytes):
    """Every Falcon-H1 layer runs attention and Mamba2 in parallel, then an MLP."""
    n = c.num_hidden_layers
    return (_bamba_style_mamba(c, n, dtype_bytes), _attention(c, n, dtype_bytes),
            cm.mlp_layers(n, c.hidden_size, c.intermediate_size))


def _granitemoehybrid(c, dtype_bytes):
    """Granite-4-H: Mamba2 or attention mixers; every layer has a shared MLP plus (if experts > 0) an MoE."""
    n, n_attention = c.num_hidden_layers, _count_attention(c.layer_types)
    groups = [_bamba_style_mamba(c, n - n_attention, dtype_bytes), _attention(c, n_attention, dtype_bytes)]
    if c.num_local_experts > 0:
        groups.append(cm.moe_layers(n, c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                    c.shared_intermediate_size))
    else:
        groups.append(cm.mlp_layers(n, c.hidden_size, c.shared_intermediate_size))
    return tuple(groups)


def _nemotron_h(c, dtype_bytes):
    """Nemotron-H: each block is one of Mamba2, attention, MLP or MoE; MLPs are non-gated (relu^2)."""
    kinds = Counter(c.layer_types)
    return (
        _mamba2(kinds["linear_attention"], c, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups,
                c.conv_kernel, dtype_bytes),
        _attention(c, kinds["full_attention"], dtype_bytes),
        cm.mlp_layers(kinds["mlp"], c.hidden_size, c.intermediate_size, gated=False),
        cm.moe_layers(kinds["moe"], c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                      c.n_shared_experts * c.moe_shared_expert_intermediate_size, gated=False,
                      latent_size=c.moe_latent_size),
    )


def _jamba(c, dtype_bytes):
    """Jamba: Mamba1 or attention mixers; MoE every `expert_layer_period` layers, a dense MLP elsewhere."""
    n, n_attention = c.num_hidden_layers, _count_attention(c.layers_block_type)
    n_moe = sum(e > 1 for e in c.layers_num_experts)
    d_inner = c.mamba_expand * c.hidden_size
    return (
        cm.mamba_layers(n - n_attention, c.hidden_size, d_inner, c.mamba_d_state, c.mamba_dt_rank, c.mamba_d_conv,
                        dtype_bytes),
        _attention(c, n_attention, dtype_bytes),
        cm.moe_layers(n_moe, c.hidden_size, c.intermediate_size, c.num_experts, c.num_experts_per_tok),
        cm.mlp_layers(n - n_moe, c.hidden_size, c.intermediate_size),
    )


def _mamba_model(c, dtype_bytes):
    """Mamba, Falcon-Mamba: Mamba1 mixers only (no attention, no MLP); Falcon-Mamba's dt / B / C norms are
    weightless."""
    return (cm.mamba_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.state_size, c.time_step_rank,
                            c.conv_kernel, dtype_bytes),)


def _zamba_shared_blocks(c, dtype_bytes: int, extra_flops: int) -> tuple[cm.LayerGroup, ...]:
    """Zamba / Zamba2 "hybrid" layers: the shared transformer block (attention reading [hidden, embeddings],
    `attention_hidden_size` wide, output h, its own KV cache per layer; a gated MLP), plus `extra_flops` per layer
    (its own h x h `linear`, Zamba2's LoRA adapters)."""
    n_hybrid = c.layers_block_type.count("hybrid")
    kv_heads = c.num_key_value_heads or c.num_attention_heads
    mlp = cm.mlp_layers(n_hybrid, c.hidden_size, c.intermediate_size)
    return (
        cm.attention_layers(n_hybrid, c.attention_hidden_size, c.num_attention_heads, kv_heads, c.attention_head_dim,
                            dtype_bytes, output_size=c.hidden_size),
        replace(mlp, linear_flops_per_token=mlp.linear_flops_per_token + extra_flops),
    )


def _zamba(c, dtype_bytes):
    """Zamba: every layer is a Mamba1 mixer split into `n_mamba_heads` heads (per-head x_proj / dt_proj, together
    the weights of one Mamba1 x_proj / dt_proj); "hybrid" layers first run the shared block (no RoPE) and a
    `linear`."""
    h = c.hidden_size
    return (
        cm.mamba_layers(c.num_hidden_layers, h, c.mamba_expand * h, c.mamba_d_state, c.mamba_dt_rank, c.mamba_d_conv,
                        dtype_bytes),
        *_zamba_shared_blocks(c, dtype_bytes, 2 * h * h),
    )


def _zamba2(c, dtype_bytes):
    """Zamba2: every layer is Mamba2; "hybrid" layers first run the shared block (its MLP with a LoRA adapter on
    gate_up) and a `linear`. The optional attention adapters (`use_shared_attention_adapter`) are left out."""
    h = c.hidden_size
    heads = int(c.mamba_expand * h) // c.mamba_headdim
    adapter_and_linear = 2 * c.adapter_rank * (h + 2 * c.intermediate_size) + 2 * h * h
    return (
        _mamba2(c.num_hidden_layers, c, heads, c.mamba_headdim, c.mamba_d_state, c.mamba_ngroups, c.mamba_d_conv,
                dtype_bytes),
        *_zamba_shared_blocks(c, dtype_bytes, adapter_and_linear),
    )


def _lfm_mixers(c, dtype_bytes: int, head_gate: bool = False) -> tuple[cm.LayerGroup, ...]:
    """LFM2 / LFM2-MoE / LFM3: gated short convs ("conv") or attention layers (QK-norm; LFM3's may gate each head)."""
    if c.layer_types is None:  # (Lfm2MoeConfig's default: its model cannot be built either)
        raise InvalidInputError(f"{c.model_type} config has layer_types=None; set one of 'conv' / 'full_attention' "
                                "per layer, as the model's checkpoint config does")
    n_attention = _count_attention(c.layer_types)
    attention = _attention(c, n_attention, dtype_bytes)
    return (cm.short_conv_layers(c.num_hidden_layers - n_attention, c.hidden_size, c.conv_L_cache, dtype_bytes),
            cm.head_gated(attention) if head_gate else attention)


def _lfm2(c, dtype_bytes):
    """LFM2: each mixer is followed by a SwiGLU MLP (width auto-adjusted as Lfm2MLP does)."""
    intermediate = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        intermediate = int(2 * intermediate / 3)
        if c.block_ffn_dim_multiplier is not None:
            intermediate = int(c.block_ffn_dim_multiplier * intermediate)
            intermediate = c.block_multiple_of * -(-intermediate // c.block_multiple_of)
    return (*_lfm_mixers(c, dtype_bytes), cm.mlp_layers(c.num_hidden_layers, c.hidden_size, intermediate))


def _lfm2_moe(c, dtype_bytes):
    """LFM2-MoE: LFM2's mixers; the first `num_dense_layers` MLPs are dense (`intermediate_size`, not adjusted),
    the rest sparse (sigmoid router, `num_experts_per_tok` of `num_experts`, no shared expert)."""
    n = c.num_hidden_layers
    n_dense = min(c.num_dense_layers, n)
    return (
        *_lfm_mixers(c, dtype_bytes),
        cm.mlp_layers(n_dense, c.hidden_size, c.intermediate_size),
        cm.moe_layers(n - n_dense, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok),
    )


def _lfm3(c, dtype_bytes):
    """LFM3: LFM2's mixers with a per-head sigmoid gate on attention (`use_attention_gate`), each followed by a
    SwiGLU MLP of `intermediate_size`. Its sliding-window layers (in the default `layer_types`) are refused."""
    _refuse_windowed(c, [t for t in c.layer_types if t == "sliding_attention"],
                     "only configs whose layer_types are all 'conv' or 'full_attention' are served; turning the "
                     "sliding layers into full ones changes the model (another RoPE per layer type)")
    return (*_lfm_mixers(c, dtype_bytes, head_gate=c.use_attention_gate),
            cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size))


def _olmo_hybrid(c, dtype_bytes):
    """OLMo Hybrid: GatedDeltaNet (separate q, k, v, a, b, g projections: the widths of Qwen's fused ones) or
    Olmo3 attention (QK-norm, no output gate), each followed by a SwiGLU MLP."""
    return (*_gdn_and_attention(c, dtype_bytes, gated=False),
            cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size))


def _kda(c, count: int, dtype_bytes: int, full_rank_gates: bool = False) -> cm.LayerGroup:
    return cm.kda_layers(count, c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim,
                         dtype_bytes, full_rank_gates=full_rank_gates)


def _mla(c, count: int, dtype_bytes: int) -> cm.LayerGroup:
    return cm.mla_attention_layers(count, c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim,
                                   c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank, getattr(c, "q_lora_rank", None),
                                   dtype_bytes)


def _deepseek_mlps(c, n: int) -> tuple[cm.LayerGroup, cm.LayerGroup]:
    """Dense MLPs, or ("sparse" in `mlp_layer_types`) DeepSeek-V3 MoEs with `n_shared_experts` always-on experts."""
    n_sparse = c.mlp_layer_types[:n].count("sparse")
    return (cm.moe_layers(n_sparse, c.hidden_size, c.moe_intermediate_size, c.num_local_experts,
                          c.num_experts_per_tok, c.moe_intermediate_size * c.n_shared_experts),
            cm.mlp_layers(n - n_sparse, c.hidden_size, c.intermediate_size))


def _kimi_linear(c, dtype_bytes):
    """Kimi Linear: KDA ("linear_attention", low-rank forget / output gates) or MLA ("full_attention", caching the
    latents; optionally low-rank Q); dense or DeepSeek-V3 MoE MLPs."""
    n = c.num_hidden_layers
    n_attention = _count_attention(c.layer_types[:n])
    return _kda(c, n - n_attention, dtype_bytes), _mla(c, n_attention, dtype_bytes), *_deepseek_mlps(c, n)


def _bailing_hybrid(c, dtype_bytes):
    """Ling hybrid (bailing_hybrid): Kimi's layout with full-rank KDA gates (f_proj, g_proj) and MLA (full-rank Q)
    whose heads are gated by a sigmoid of g_proj (one scalar per head). Its optional MTP modules are not built."""
    n = c.num_hidden_layers
    n_attention = _count_attention(c.layer_types[:n])
    return (_kda(c, n - n_attention, dtype_bytes, full_rank_gates=True),
            cm.head_gated(_mla(c, n_attention, dtype_bytes)), *_deepseek_mlps(c, n))


def _glm5_next(c, dtype_bytes):
    """GLM-5-Next: Kimi Linear's KDA and MLPs, its MLA ("indexed_attention", NoPE) with a DSA indexer that caches
    per-token keys (layers whose `indexer_types` is "full"; a "shared" layer reuses the previous one's selection),
    and every mixer and MLP behind `hc_mult`-stream hyper-connections (counted with the MLPs)."""
    n = c.num_hidden_layers
    attention = [i for i in range(n) if c.layer_types[i] == "indexed_attention"]
    n_indexed = sum(c.indexer_types[i] != "shared" for i in attention)
    indexed = cm.with_dsa_indexer(_mla(c, n_indexed, dtype_bytes), c.hidden_size, c.q_lora_rank, c.index_n_heads,
                                  c.index_head_dim, c.index_kpool, dtype_bytes)
    mlps = (cm.with_hyper_connections(group, c.hidden_size, c.hc_mult) for group in _deepseek_mlps(c, n))
    return (_kda(c, n - len(attention), dtype_bytes), indexed, _mla(c, len(attention) - n_indexed, dtype_bytes),
            *mlps)


def _zaya(c, dtype_bytes):
    """ZAYA: every layer is attention behind a CCA projection (KV + a conv state and the previous token's delayed
    V, `cm.cca_attention_layers`) and a top-1 MoE whose router is an MLP (`h -> r`, two `r x r`, `r -> E + 1`:
    the extra class skips the experts). "hybrid_sliding" layers keep a bounded KV window: refused."""
    n = c.num_hidden_layers
    windowed = sorted({t for t in c.layer_types[:n] if t != "hybrid"})
    if windowed:
        raise UnsupportedModelError(
            f"zaya: layer types {windowed} keep a bounded KV window (transformers' DynamicSlidingWindowLayer drops "
            "tokens older than sliding_window), so a prefix cannot be resumed from it; only \"hybrid\" layers are "
            "supported (layer_types=['hybrid'] * num_hidden_layers)")
    if c.cca_time0 + c.cca_time1 < 3:
        raise UnsupportedModelError(
            f"zaya: cca_time0={c.cca_time0}, cca_time1={c.cca_time1} leave the CCA conv no history, and "
            "transformers' ZayaCCAProjection then caches its whole input (qk_states[..., -0:]): not supported")
    r, experts = c.router_hidden_size, c.num_experts
    moe = cm.moe_layers(n, c.hidden_size, c.moe_intermediate_size, experts, c.num_experts_per_tok)
    router = 2 * c.hidden_size * r + 4 * r * r + 2 * r * (experts + 1)
    return (
        cm.cca_attention_layers(n, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                c.cca_time0, c.cca_time1, dtype_bytes),
        replace(moe, linear_flops_per_token=moe.linear_flops_per_token - 2 * c.hidden_size * experts + router),
    )


def _inkling_attention(c, dtype_bytes: int, gated: bool) -> cm.LayerGroup:
    """Inkling / Inkling2 attention: a relative-position bias (`r_proj` to `d_rel` per head, mixed into
    `rel_extent` profiles), short convs (`2 K` per channel) on K and V and on the attention and MLP outputs, each
    keeping K columns of fp32 state. "hybrid_sliding" layers keep a bounded KV window: refused."""
    n, h = c.num_hidden_layers, c.hidden_size
    windowed = sorted({t for t in c.layer_types[:n] if t != "hybrid"})
    if windowed:
        raise UnsupportedModelError(
            f"{c.model_type}: layer types {windowed} keep a bounded KV window (transformers' "
            "DynamicSlidingWindowLayer drops tokens older than sliding_window_size), so a prefix cannot be resumed "
            "from it; only \"hybrid\" layers are supported (layer_types=['hybrid'] * num_hidden_layers"
            f"{', or local_layer_ids=[]' if hasattr(c, 'local_layer_ids') else ''})")
    kv_dim, heads, k = c.num_key_value_heads * c.head_dim, c.num_attention_heads, c.conv_kernel_size
    attention = _attention(c, n, dtype_bytes, gated)
    extra = 2 * h * heads * c.d_rel + 2 * heads * c.d_rel * c.rel_extent + 2 * k * (2 * kv_dim + 2 * h)
    return replace(attention, linear_flops_per_token=attention.linear_flops_per_token + extra,
                   state_bytes=k * (2 * kv_dim + 2 * h) * cm.FP32_BYTES)


def _inkling(c, dtype_bytes):
    """Inkling: `_inkling_attention`, then a dense or MoE MLP (its router scores the shared experts too, which are
    always on)."""
    n, h = c.num_hidden_layers, c.hidden_size
    attention = _inkling_attention(c, dtype_bytes, gated=False)
    n_sparse = c.mlp_layer_types[:n].count("sparse")
    moe = cm.moe_layers(n_sparse, h, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                        c.n_shared_experts * c.moe_intermediate_size)
    moe = replace(moe, linear_flops_per_token=moe.linear_flops_per_token + 2 * h * c.n_shared_experts)
    return attention, moe, cm.mlp_layers(n - n_sparse, h, c.intermediate_size)


def _inkling2(c, dtype_bytes):
    """Inkling2 (full-attention layers): `_inkling_attention` with a sigmoid output gate, a sink logit per head
    (`sink_proj`) and dynamic K / V convs (their taps also projected from the layer input, `2 h kv_heads K` each),
    then a MoE MLP. The block attention residuals (a softmax over the few block states per token)
    are left out, as norms are."""
    n, h, k = c.num_hidden_layers, c.hidden_size, c.conv_kernel_size
    attention = _inkling_attention(c, dtype_bytes, gated=True)
    extra = 2 * h * c.num_attention_heads + 2 * 2 * h * c.num_key_value_heads * k
    return (replace(attention, linear_flops_per_token=attention.linear_flops_per_token + extra),
            cm.moe_layers(n, h, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok))
def _qwen4_exp(c, dtype_bytes):
    """Qwen4-Exp: GatedDeltaNet ("linear_attention") or gated attention with a QSA indexer ("indexed_attention"),
    an MoE in every layer, each block read and written through hyper-connections over `hc_count` residual streams
    (one more mixer at the end), and PLE on the `ple_layer_ids` (one-indexed) layers."""
    n, n_attention = c.num_hidden_layers, c.layer_types.count("indexed_attention")
    if n_attention and c.indexer_n_heads is None:
        raise UnsupportedModelError("qwen4_exp: indexed_attention layers need the QSA indexer_* config fields "
                                    "(transformers' Qwen4ExpTextQSAIndexer cannot be built without them)")
    gdn = cm.gated_deltanet_layers(
        n - n_attention, c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
        c.linear_value_head_dim, c.linear_conv_kernel_dim, dtype_bytes)
    attention = cm.with_qsa_indexer(_attention(c, n_attention, dtype_bytes, gated=True), c.hidden_size,
                                    c.indexer_n_heads, c.indexer_head_dim, c.indexer_compress_ratio, dtype_bytes)
    return (
        gdn, attention, _qwen_moe(c, n),
        cm.ple_layers(len(c.ple_layer_ids), c.hidden_size, c.hc_count, c.ple_embed_dim, c.ple_conv_kernel_size,
                      c.ngram_size, dtype_bytes),
        cm.gated_residual_layers(2 * n, c.hidden_size, c.hc_count, c.hc_lowrank),
        cm.gated_residual_layers(1, c.hidden_size, c.hc_count, c.hc_lowrank, inject=False),
    )


def _qwen4_exp_fresh(c) -> dict[tuple[int, int], int]:
    """A PLE layer's n-gram context (state 2 of its cache layer) starts as eos ids (Qwen4ExpTextNGramEmbedding)."""
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return {(layer_id - 1, 2): eos for layer_id in c.ple_layer_ids}


# KV-only decoders read by `_dense`: q, k, v, o attention and a gated MLP in every layer, nothing recurrent.
DENSE_MODEL_TYPES = ("gemma", "llama", "mistral", "qwen2", "qwen3")


def _dense(c, dtype_bytes):
    """Llama-style decoder (DENSE_MODEL_TYPES): attention + SwiGLU / GeGLU MLP per layer, `state_bytes` 0. Sliding-
    window or chunked layers (read as transformers' DynamicCache does) keep a bounded KV window, which the
    per-token byte count cannot express, so such configs are refused."""
    n = c.num_hidden_layers
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None:
        if getattr(c, "sliding_window", None) is not None:
            layer_types = ["sliding_attention"] * n
        elif getattr(c, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * n
        else:
            layer_types = ["full_attention"] * n
    _refuse_windowed(c, [t for t in layer_types[:n] if t != "full_attention"],
                     "only full attention is supported (e.g. sliding_window=None, use_sliding_window=False)")
    return _attention(c, n, dtype_bytes), cm.mlp_layers(n, c.hidden_size, c.intermediate_size)


@dataclass(frozen=True)
class ModelFamily:
    """One model_type: `reader` (config, dtype bytes) -> its ModelSpec layer groups; `layer_family`, the
    prefixlab.recurrent.families class that patches its linear-attention layers (None: KV-only); `patched_only`, why
    transformers' own layers cannot resume exactly (then only a patched model is served); `fresh_states`, the conv
    states a fresh sequence does not start at zeros (a batch row resuming nothing gets these); `indexer_positions`,
    whether the model keeps its indexers' position history on its first indexed layer (rebuilt on a resume)."""

    reader: Callable
    layer_family: str | None
    patched_only: str | None = None
    fresh_states: Callable | None = None  # config -> {(layer, state index): fresh value} where that is not 0
    indexer_positions: bool = False  # its first indexed layer keeps the indexers' position history (Qwen4-Exp)


# transformers 5.23's Mamba1 mixers (Jamba, Mamba, Falcon-Mamba) never hand the cached recurrent state to a
# multi-token scan (mamba_selective_scan and mamba_ssm's selective_scan_fn take none; the torch loop starts at zeros)
_MAMBA1_RESTARTS = "{}'s multi-token scan starts from zeros, not from the cached state (transformers 5.23)"

# Adding a family: its row here (and its reader above; a new kind of recurrent layer also needs a
# prefixlab.recurrent.families class). tests/test_hf_families.py checks `layer_family` against a tiny model.
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "qwen3_5": ModelFamily(_qwen3_5, "GatedDeltaNet"),
    "qwen3_5_moe": ModelFamily(_qwen3_5_moe, "GatedDeltaNet"),
    "qwen3_next": ModelFamily(_qwen3_next, "Qwen3NextGatedDeltaNet"),
    "qwen4_exp": ModelFamily(_qwen4_exp, "GatedDeltaNet", fresh_states=_qwen4_exp_fresh, indexer_positions=True),
    "olmo_hybrid": ModelFamily(_olmo_hybrid, "OlmoHybridGatedDeltaNet"),
    "kimi_linear": ModelFamily(_kimi_linear, "KimiDeltaAttention"),
    "glm5_next": ModelFamily(_glm5_next, "KimiDeltaAttention"),
    "nemotron_h": ModelFamily(_nemotron_h, "Mamba2Mixer"),
    "bamba": ModelFamily(_bamba, "Mamba2Mixer"),
    "falcon_h1": ModelFamily(_falcon_h1, "FalconH1Mixer"),
    "granitemoehybrid": ModelFamily(_granitemoehybrid, "Mamba2Mixer"),
    "zamba2": ModelFamily(_zamba2, "Mamba2Mixer"),
    "zamba": ModelFamily(_zamba, "MultiHeadMambaMixer", patched_only=_MAMBA1_RESTARTS.format("ZambaMambaMixer")),
    "mamba2": ModelFamily(_mamba2_model, "Mamba2Mixer"),
    "jamba": ModelFamily(_jamba, "NormalisedMambaMixer", patched_only=_MAMBA1_RESTARTS.format("JambaMambaMixer")),
    "mamba": ModelFamily(_mamba_model, "MambaMixer", patched_only=_MAMBA1_RESTARTS.format("MambaMixer")),
    "falcon_mamba": ModelFamily(_mamba_model, "NormalisedMambaMixer",
                                patched_only=_MAMBA1_RESTARTS.format("FalconMambaMixer")),
    "bailing_hybrid": ModelFamily(_bailing_hybrid, "BailingHybridDeltaAttention"),
    "lfm2": ModelFamily(_lfm2, "ShortConv"),
    "lfm2_moe": ModelFamily(_lfm2_moe, "ShortConv"),
    "lfm3": ModelFamily(_lfm3, "ShortConv"),
    "zaya": ModelFamily(_zaya, "ZayaCCA"),
    "inkling": ModelFamily(_inkling, "InlineShortConv"),
    "inkling2": ModelFamily(_inkling2, "InlineShortConv"),
    **{model_type: ModelFamily(_dense, None) for model_type in DENSE_MODEL_TYPES},
}
READERS: dict[str, Callable] = {model_type: family.reader for model_type, family in MODEL_FAMILIES.items()}

# Hybrid model types that are not served, with why (transformers 5.23) and what it would take: the refusal says so.
REFUSED_MODEL_TYPES: dict[str, str] = {
    "minimax": (
        "MiniMaxModel.forward accepts no cache but its own MiniMaxCache (modeling_minimax.py:652, a ValueError for "
        "any other, HybridPrefixCache included), which keeps each lightning-attention layer's state (the decayed "
        "K^T V sum) in a list of its own (MiniMaxCache.linear_cache, set / read at modeling_minimax.py:199 and 269), "
        "not in the cache layers' recurrent states that prefixlab checkpoints and restores. Serve it with "
        "transformers' own MiniMaxCache, without prefix reuse"),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(READERS))


def keeps_recurrent_state(config) -> bool:
    """Whether the model's linear-attention cache layers hold a recurrent state besides the conv state (LFM2's
    short convolutions hold only the conv state). True for a model type this table does not know."""
    from prefixlab.recurrent.families import FAMILIES

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    family = MODEL_FAMILIES.get((getattr(text, "model_type", None) or "").removesuffix("_text"))
    layer_family = next((f for f in FAMILIES if family is not None and type(f).__name__ == family.layer_family), None)
    return layer_family is None or layer_family.has_recurrent_state


def selection_limit(config) -> int | None:
    """The tokens up to which GLM-5-Next's DSA indexer selects every key a query may see, whatever the forward's
    length; None for other models. From there on a query attends to `index_topk // index_kpool` of the complete pools
    before it, picked by `index_scores.topk` over the forward's every pool (transformers 5.23 modeling_glm5_next.py
    :889, masked future pools included), and its ReLU'd scores (:863) tie exactly (at 0) where no head scores a
    pool positive: topk breaks such ties by the row's length, so the same tokens select other keys in a forward of
    another length. A prefix stored from one request would then not be what another request's own prefill computes:
    nothing past this limit is stored or resumed (a longer prompt still reuses its first `limit` tokens)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    topk, pool = getattr(text, "index_topk", None), getattr(text, "index_kpool", None)
    # a query at position p sees (p + 1) // pool complete pools: all of them are selected while p + 1 < (K + 1) pool
    return None if topk is None or pool is None else (topk // pool + 1) * pool - 1
def pads_shift_positions(config) -> bool:
    """Whether a left pad moves a row's tokens to other positions in what the model computes: Inkling's log-scaled
    attention (`log_scaling_n_floor`) scales each query by its position counted in cache columns, pads included
    (modeling_inkling.py InklingAttention.forward: get_query_offset, then tau of q_positions)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) == "inkling_text" and text.log_scaling_n_floor is not None


def family_of(config) -> ModelFamily:
    """The MODEL_FAMILIES row of a config (its text config's), or a row of defaults for a type it does not know."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return MODEL_FAMILIES.get((getattr(text, "model_type", None) or "").removesuffix("_text"), ModelFamily(None, None))


def fresh_states(config) -> dict[tuple[int, int], int]:
    """{(layer, state index): value} of the conv states that start at that value, not 0, in a fresh sequence."""
    family = family_of(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return family.fresh_states(text) if family.fresh_states is not None else {}


def spec_from_config(config, dtype: torch.dtype | str | None = None) -> cm.ModelSpec:
    """ModelSpec of a transformers config (multimodal configs use their text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or ""
    reader = READERS.get(model_type.removesuffix("_text"))
    if model_type.removesuffix("_text") in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported: "
                                    f"{REFUSED_MODEL_TYPES[model_type.removesuffix('_text')]}")
    if reader is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({type(config).__name__}) is not supported by the cost model; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    dtype_bytes = _dtype_bytes(text, dtype)
    groups = tuple(g for g in reader(text, dtype_bytes) if g.count > 0)
    return cm.ModelSpec(model_type.removesuffix("_text"), text.hidden_size, dtype_bytes, groups)
