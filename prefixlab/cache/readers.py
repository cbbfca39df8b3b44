"""Cost-model readers: a transformers (5.x) config -> the ModelSpec layer groups of its model, one per model_type
(hfspec.MODEL_FAMILIES names them; the Mamba families' are in readers_ssm.py).

Each reader mirrors the model's modeling file in transformers/models/<name>/: the layer pattern
(`layer_types`, `layers_block_type`, `mlp_layer_types`, periods/offsets), head and state dims, conv kernels, MoE
expert counts. KV-only decoders (DENSE_MODEL_TYPES) share one generic reader.
Byte counts are exact (tests compare them with a tiny model's cache tensors); FLOPs use `costmodel`'s formulas.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from prefixlab.cache import costmodel as cm
from prefixlab.cache import costmodel_variants as cmv
from prefixlab.errors import InvalidInputError, UnsupportedModelError

ATTENTION_TYPES = ("full_attention", "attention", "sliding_attention")


def dtype_bytes_of(config, dtype: torch.dtype | str | None) -> int:
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


def attention_of(c, count: int, dtype_bytes: int, gated: bool = False) -> cm.LayerGroup:
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return cm.attention_layers(count, c.hidden_size, c.num_attention_heads, kv_heads, _head_dim(c), dtype_bytes, gated)


def count_attention(layer_types) -> int:
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
    n_attention = count_attention(c.layer_types)
    gdn = cm.gated_deltanet_layers(
        len(c.layer_types) - n_attention, c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
        c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim, dtype_bytes,
    )
    return gdn, attention_of(c, n_attention, dtype_bytes, gated)


def _qwen_gdn(c, dtype_bytes: int) -> tuple[cm.LayerGroup, ...]:
    """Qwen3-Next / Qwen3.5: GatedDeltaNet + full attention with a sigmoid output gate."""
    return _gdn_and_attention(c, dtype_bytes, gated=True)


def _qwen_moe(c, count: int) -> cm.LayerGroup:
    return cm.moe_layers(count, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                         c.shared_expert_intermediate_size, shared_expert_gate=True)


def qwen3_5(c, dtype_bytes):
    return (*_qwen_gdn(c, dtype_bytes), cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size))


def qwen3_5_moe(c, dtype_bytes):
    return (*_qwen_gdn(c, dtype_bytes), _qwen_moe(c, c.num_hidden_layers))


def qwen3_next(c, dtype_bytes):
    sparse = [
        i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        for i in range(c.num_hidden_layers)
    ]
    dense = cm.mlp_layers(sparse.count(False), c.hidden_size, c.intermediate_size)
    return (*_qwen_gdn(c, dtype_bytes), _qwen_moe(c, sum(sparse)), dense)



def _lfm_mixers(c, dtype_bytes: int, head_gate: bool = False) -> tuple[cm.LayerGroup, ...]:
    """LFM2 / LFM2-MoE / LFM3: gated short convs ("conv") or attention layers (QK-norm; LFM3's may gate each head)."""
    if c.layer_types is None:  # (Lfm2MoeConfig's default: its model cannot be built either)
        raise InvalidInputError(f"{c.model_type} config has layer_types=None; set one of 'conv' / 'full_attention' "
                                "per layer, as the model's checkpoint config does")
    n_attention = count_attention(c.layer_types)
    attention = attention_of(c, n_attention, dtype_bytes)
    return (cm.short_conv_layers(c.num_hidden_layers - n_attention, c.hidden_size, c.conv_L_cache, dtype_bytes),
            cmv.head_gated(attention) if head_gate else attention)


def lfm2(c, dtype_bytes):
    """LFM2: each mixer is followed by a SwiGLU MLP (width auto-adjusted as Lfm2MLP does)."""
    intermediate = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        intermediate = int(2 * intermediate / 3)
        if c.block_ffn_dim_multiplier is not None:
            intermediate = int(c.block_ffn_dim_multiplier * intermediate)
            intermediate = c.block_multiple_of * -(-intermediate // c.block_multiple_of)
    return (*_lfm_mixers(c, dtype_bytes), cm.mlp_layers(c.num_hidden_layers, c.hidden_size, intermediate))


def lfm2_moe(c, dtype_bytes):
    """LFM2-MoE: LFM2's mixers; the first `num_dense_layers` MLPs are dense (`intermediate_size`, not adjusted),
    the rest sparse (sigmoid router, `num_experts_per_tok` of `num_experts`, no shared expert)."""
    n = c.num_hidden_layers
    n_dense = min(c.num_dense_layers, n)
    return (
        *_lfm_mixers(c, dtype_bytes),
        cm.mlp_layers(n_dense, c.hidden_size, c.intermediate_size),
        cm.moe_layers(n - n_dense, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok),
    )


def lfm3(c, dtype_bytes):
    """LFM3: LFM2's mixers with a per-head sigmoid gate on attention (`use_attention_gate`), each followed by a
    SwiGLU MLP of `intermediate_size`. Its sliding-window layers (in the default `layer_types`) are refused."""
    _refuse_windowed(c, [t for t in c.layer_types if t == "sliding_attention"],
                     "only configs whose layer_types are all 'conv' or 'full_attention' are served; turning the "
                     "sliding layers into full ones changes the model (another RoPE per layer type)")
    return (*_lfm_mixers(c, dtype_bytes, head_gate=c.use_attention_gate),
            cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size))


def olmo_hybrid(c, dtype_bytes):
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


def kimi_linear(c, dtype_bytes):
    """Kimi Linear: KDA ("linear_attention", low-rank forget / output gates) or MLA ("full_attention", caching the
    latents; optionally low-rank Q); dense or DeepSeek-V3 MoE MLPs."""
    n = c.num_hidden_layers
    n_attention = count_attention(c.layer_types[:n])
    return _kda(c, n - n_attention, dtype_bytes), _mla(c, n_attention, dtype_bytes), *_deepseek_mlps(c, n)


def bailing_hybrid(c, dtype_bytes):
    """Ling hybrid (bailing_hybrid): Kimi's layout with full-rank KDA gates (f_proj, g_proj) and MLA (full-rank Q)
    whose heads are gated by a sigmoid of g_proj (one scalar per head). Its optional MTP modules are not built."""
    n = c.num_hidden_layers
    n_attention = count_attention(c.layer_types[:n])
    return (_kda(c, n - n_attention, dtype_bytes, full_rank_gates=True),
            cmv.head_gated(_mla(c, n_attention, dtype_bytes)), *_deepseek_mlps(c, n))


def glm5_next(c, dtype_bytes):
    """GLM-5-Next: Kimi Linear's KDA and MLPs, its MLA ("indexed_attention", NoPE) with a DSA indexer that caches
    per-token keys (layers whose `indexer_types` is "full"; a "shared" layer reuses the previous one's selection),
    and every mixer and MLP behind `hc_mult`-stream hyper-connections (counted with the MLPs)."""
    n = c.num_hidden_layers
    attention = [i for i in range(n) if c.layer_types[i] == "indexed_attention"]
    n_indexed = sum(c.indexer_types[i] != "shared" for i in attention)
    indexed = cmv.with_dsa_indexer(_mla(c, n_indexed, dtype_bytes), c.hidden_size, c.q_lora_rank, c.index_n_heads,
                                  c.index_head_dim, c.index_kpool, dtype_bytes)
    mlps = (cmv.with_hyper_connections(group, c.hidden_size, c.hc_mult) for group in _deepseek_mlps(c, n))
    return (_kda(c, n - len(attention), dtype_bytes), indexed, _mla(c, len(attention) - n_indexed, dtype_bytes),
            *mlps)


def zaya(c, dtype_bytes):
    """ZAYA: every layer is attention behind a CCA projection (KV + a conv state and the previous token's delayed
    V, `cmv.cca_attention_layers`) and a top-1 MoE whose router is an MLP (`h -> r`, two `r x r`, `r -> E + 1`:
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
        cmv.cca_attention_layers(n, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
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
    attention = attention_of(c, n, dtype_bytes, gated)
    extra = 2 * h * heads * c.d_rel + 2 * heads * c.d_rel * c.rel_extent + 2 * k * (2 * kv_dim + 2 * h)
    return replace(attention, linear_flops_per_token=attention.linear_flops_per_token + extra,
                   state_bytes=k * (2 * kv_dim + 2 * h) * cm.FP32_BYTES)


def inkling(c, dtype_bytes):
    """Inkling: `_inkling_attention`, then a dense or MoE MLP (its router scores the shared experts too, which are
    always on)."""
    n, h = c.num_hidden_layers, c.hidden_size
    attention = _inkling_attention(c, dtype_bytes, gated=False)
    n_sparse = c.mlp_layer_types[:n].count("sparse")
    moe = cm.moe_layers(n_sparse, h, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                        c.n_shared_experts * c.moe_intermediate_size)
    moe = replace(moe, linear_flops_per_token=moe.linear_flops_per_token + 2 * h * c.n_shared_experts)
    return attention, moe, cm.mlp_layers(n - n_sparse, h, c.intermediate_size)


def inkling2(c, dtype_bytes):
    """Inkling2 (full-attention layers): `_inkling_attention` with a sigmoid output gate, a sink logit per head
    (`sink_proj`) and dynamic K / V convs (their taps also projected from the layer input, `2 h kv_heads K` each),
    then a MoE MLP. The block attention residuals (a softmax over the few block states per token)
    are left out, as norms are."""
    n, h, k = c.num_hidden_layers, c.hidden_size, c.conv_kernel_size
    attention = _inkling_attention(c, dtype_bytes, gated=True)
    extra = 2 * h * c.num_attention_heads + 2 * 2 * h * c.num_key_value_heads * k
    return (replace(attention, linear_flops_per_token=attention.linear_flops_per_token + extra),
            cm.moe_layers(n, h, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok))
def qwen4_exp(c, dtype_bytes):
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
    attention = cmv.with_qsa_indexer(attention_of(c, n_attention, dtype_bytes, gated=True), c.hidden_size,
                                    c.indexer_n_heads, c.indexer_head_dim, c.indexer_compress_ratio, dtype_bytes)
    return (
        gdn, attention, _qwen_moe(c, n),
        cmv.ple_layers(len(c.ple_layer_ids), c.hidden_size, c.hc_count, c.ple_embed_dim, c.ple_conv_kernel_size,
                      c.ngram_size, dtype_bytes),
        cmv.gated_residual_layers(2 * n, c.hidden_size, c.hc_count, c.hc_lowrank),
        cmv.gated_residual_layers(1, c.hidden_size, c.hc_count, c.hc_lowrank, inject=False),
    )


def qwen4_exp_fresh(c) -> dict[tuple[int, int], int]:
    """A PLE layer's n-gram context (state 2 of its cache layer) starts as eos ids (Qwen4ExpTextNGramEmbedding)."""
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return {(layer_id - 1, 2): eos for layer_id in c.ple_layer_ids}


def minimax(c, dtype_bytes):
    """MiniMax(-Text-01): lightning attention ("linear_attention") or GQA ("full_attention") layers, each followed by a
    Mixtral-style MoE (softmax router, `num_experts_per_tok` of `num_local_experts`). Sliding windows are refused."""
    n = c.num_hidden_layers
    if c.sliding_window is not None:  # (untested here: its full-attention cache layers with a windowed mask)
        raise UnsupportedModelError(f"minimax with sliding_window={c.sliding_window} is not supported; use "
                                    "sliding_window=None")
    n_attention = count_attention(c.layer_types[:n])
    return (cmv.lightning_layers(n - n_attention, c.hidden_size, c.num_attention_heads, _head_dim(c), dtype_bytes),
            attention_of(c, n_attention, dtype_bytes),
            cm.moe_layers(n, c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok))


# KV-only decoders read by `dense`: q, k, v, o attention and a gated MLP in every layer, nothing recurrent.
DENSE_MODEL_TYPES = ("gemma", "llama", "mistral", "qwen2", "qwen3")


def dense(c, dtype_bytes):
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
    return attention_of(c, n, dtype_bytes), cm.mlp_layers(n, c.hidden_size, c.intermediate_size)

