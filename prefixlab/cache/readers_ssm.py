"""Cost-model readers of the Mamba1 / Mamba2 families (Bamba, Falcon-H1, Granite-4-H, Nemotron-H, Jamba, Zamba,
Zamba2, Mamba, Falcon-Mamba, Mamba2); see readers.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from prefixlab.cache import costmodel as cm
from prefixlab.cache.readers import attention_of, count_attention


def _mamba2(count: int, c, heads: int, head_dim: int, state: int, groups: int, conv: int, dtype_bytes: int):
    return cm.mamba2_layers(count, c.hidden_size, heads, head_dim, state, groups, conv, dtype_bytes)


def mamba2_model(c, dtype_bytes):
    return (_mamba2(c.num_hidden_layers, c, c.num_heads, c.head_dim, c.state_size, c.n_groups, c.conv_kernel,
                    dtype_bytes),)


def _bamba_style_mamba(c, count: int, dtype_bytes: int) -> cm.LayerGroup:
    """Bamba, Falcon-H1 and Granite-4-H share the `mamba_*` config names."""
    return _mamba2(count, c, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups, c.mamba_d_conv,
                   dtype_bytes)


def bamba(c, dtype_bytes):
    n_attention = count_attention(c.layers_block_type)
    return (
        _bamba_style_mamba(c, c.num_hidden_layers - n_attention, dtype_bytes),
        attention_of(c, n_attention, dtype_bytes),
        cm.mlp_layers(c.num_hidden_layers, c.hidden_size, c.intermediate_size),
    )


def falcon_h1(c, dtype_bytes):
    """Every Falcon-H1 layer runs attention and Mamba2 in parallel, then an MLP."""
    n = c.num_hidden_layers
    return (_bamba_style_mamba(c, n, dtype_bytes), attention_of(c, n, dtype_bytes),
            cm.mlp_layers(n, c.hidden_size, c.intermediate_size))


def granitemoehybrid(c, dtype_bytes):
    """Granite-4-H: Mamba2 or attention mixers; every layer has a shared MLP plus (if experts > 0) an MoE."""
    n, n_attention = c.num_hidden_layers, count_attention(c.layer_types)
    groups = [_bamba_style_mamba(c, n - n_attention, dtype_bytes), attention_of(c, n_attention, dtype_bytes)]
    if c.num_local_experts > 0:
        groups.append(cm.moe_layers(n, c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                    c.shared_intermediate_size))
    else:
        groups.append(cm.mlp_layers(n, c.hidden_size, c.shared_intermediate_size))
    return tuple(groups)


def nemotron_h(c, dtype_bytes):
    """Nemotron-H: each block is one of Mamba2, attention, MLP or MoE; MLPs are non-gated (relu^2)."""
    kinds = Counter(c.layer_types)
    return (
        _mamba2(kinds["linear_attention"], c, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups,
                c.conv_kernel, dtype_bytes),
        attention_of(c, kinds["full_attention"], dtype_bytes),
        cm.mlp_layers(kinds["mlp"], c.hidden_size, c.intermediate_size, gated=False),
        cm.moe_layers(kinds["moe"], c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                      c.n_shared_experts * c.moe_shared_expert_intermediate_size, gated=False,
                      latent_size=c.moe_latent_size),
    )


def jamba(c, dtype_bytes):
    """Jamba: Mamba1 or attention mixers; MoE every `expert_layer_period` layers, a dense MLP elsewhere."""
    n, n_attention = c.num_hidden_layers, count_attention(c.layers_block_type)
    n_moe = sum(e > 1 for e in c.layers_num_experts)
    d_inner = c.mamba_expand * c.hidden_size
    return (
        cm.mamba_layers(n - n_attention, c.hidden_size, d_inner, c.mamba_d_state, c.mamba_dt_rank, c.mamba_d_conv,
                        dtype_bytes),
        attention_of(c, n_attention, dtype_bytes),
        cm.moe_layers(n_moe, c.hidden_size, c.intermediate_size, c.num_experts, c.num_experts_per_tok),
        cm.mlp_layers(n - n_moe, c.hidden_size, c.intermediate_size),
    )


def mamba_model(c, dtype_bytes):
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


def zamba(c, dtype_bytes):
    """Zamba: every layer is a Mamba1 mixer split into `n_mamba_heads` heads (per-head x_proj / dt_proj, together
    the weights of one Mamba1 x_proj / dt_proj); "hybrid" layers first run the shared block (no RoPE) and a
    `linear`."""
    h = c.hidden_size
    return (
        cm.mamba_layers(c.num_hidden_layers, h, c.mamba_expand * h, c.mamba_d_state, c.mamba_dt_rank, c.mamba_d_conv,
                        dtype_bytes),
        *_zamba_shared_blocks(c, dtype_bytes, 2 * h * h),
    )


def zamba2(c, dtype_bytes):
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
