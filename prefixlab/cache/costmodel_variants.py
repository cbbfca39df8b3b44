"""Layer kinds and variants of the newer hybrid families, in costmodel's units and conventions: per-head output
gates (LFM3, Ling), token indexers caching keys beside the KV (GLM-5-Next's DSA, Qwen4-Exp's QSA),
hyper-connections over several residual streams, ZAYA's CCA attention, Qwen4-Exp's per-layer embeddings (PLE),
MiniMax's lightning attention."""

from __future__ import annotations

from dataclasses import replace

from prefixlab.cache.costmodel import TOKEN_ID_BYTES, LayerGroup, attention_layers, dims_of


def head_gated(layers: LayerGroup) -> LayerGroup:
    """Attention `layers` (either kind above) whose heads' outputs are scaled by a sigmoid gate projected from the
    layer input, one scalar per head (LFM3, Ling's MLA): `2 h H` more per token."""
    dims = dict(layers.dims)
    return replace(layers, linear_flops_per_token=layers.linear_flops_per_token + 2 * dims["hidden"] * dims["heads"],
                   dims=(*layers.dims, ("head_gate", 1)))
def with_dsa_indexer(group: LayerGroup, hidden: int, q_lora_rank: int, heads: int, head_dim: int, pool: int,
                     dtype_bytes: int) -> LayerGroup:
    """`group`'s attention layers each also running a DSA indexer over pools of `pool` keys (GLM-5-Next), which
    caches per token its key and pool-gate scores (`head_dim` each) and a valid flag: `2 d + 1` elements.
    Projections: query from the Q latent `2 q_lora H d`, key and pool gate `2 h d` each, head weights `2 h H`;
    per (query, pool) `2 H d` scores and `2 H` for their weighting, so `2 H (d + 1) / pool` per (query, key)."""
    projections = 2 * q_lora_rank * heads * head_dim + 4 * hidden * head_dim + 2 * hidden * heads
    return replace(group, linear_flops_per_token=group.linear_flops_per_token + projections,
                   pair_flops=group.pair_flops + 2 * heads * (head_dim + 1) / pool,
                   kv_bytes_per_token=group.kv_bytes_per_token + (2 * head_dim + 1) * dtype_bytes,
                   dims=group.dims + dims_of(index_heads=heads, index_head_dim=head_dim, index_pool=pool))


def with_qsa_indexer(attention: LayerGroup, hidden: int, index_heads: int, index_head_dim: int, compress_ratio: int,
                     dtype_bytes: int) -> LayerGroup:
    """`attention` layers with a QSA token indexer (Qwen4-Exp): one projection to `index_heads` query heads and one
    key head of `index_head_dim`, the key cached per token beside K and V; each query scores mean-pooled blocks of
    `compress_ratio` keys (`2 heads dim` per block, so per pair / ratio)."""
    projection = 2 * hidden * (index_heads + 1) * index_head_dim
    return replace(attention, linear_flops_per_token=attention.linear_flops_per_token + projection,
                   pair_flops=attention.pair_flops + 2 * index_heads * index_head_dim / compress_ratio,
                   kv_bytes_per_token=attention.kv_bytes_per_token + index_head_dim * dtype_bytes,
                   dims=attention.dims + dims_of(index_heads=index_heads, index_head_dim=index_head_dim,
                                               compress_ratio=compress_ratio))


def with_hyper_connections(group: LayerGroup, hidden: int, streams: int) -> LayerGroup:
    """`group`'s layers each behind two hyper-connections (GLM-5-Next; one before the mixer, one before the MLP) over
    `streams` residual streams: a projection of the `N h` streams to `(2 + N) N` weights, `2 N h (2 + N) N`, and the
    residual mix of the streams, `2 N N h`, each."""
    flops = 2 * (2 * streams * hidden * (2 + streams) * streams + 2 * streams * streams * hidden)
    return replace(group, linear_flops_per_token=group.linear_flops_per_token + flops,
                   dims=group.dims + dims_of(hc_streams=streams))


def cca_attention_layers(
    count: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, time0: int, time1: int,
    dtype_bytes: int,
) -> LayerGroup:
    """Attention behind ZAYA's compressed convolutional (CCA) projection: Q, K and two half-width V projections
    (`2 h (q + 2 kv)`, as attention's), Q and K mixed by a depthwise conv (kernel `time0`) and a conv grouped by
    head (kernel `time1`, `2 C d t1` over C = q + kv channels of `d` per group), output `2 q h`, `4 q` per pair.
    Besides the KV, the layer keeps a state: the last `(time0 - 1) + (time1 - 1)` conv inputs and the previous
    token's delayed half of V (`kv / 2`), both in the model dtype."""
    layers = attention_layers(count, hidden, num_heads, num_kv_heads, head_dim, dtype_bytes)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    channels, history = q_dim + kv_dim, (time0 - 1) + (time1 - 1)
    convs = 2 * channels * time0 + 2 * channels * head_dim * time1
    return replace(layers, linear_flops_per_token=layers.linear_flops_per_token + convs,
                   state_bytes=(channels * history + kv_dim // 2) * dtype_bytes,
                   dims=layers.dims + dims_of(time0=time0, time1=time1))


def ple_layers(count: int, hidden: int, streams: int, embed_dim: int, conv_kernel: int, dilation: int,
               dtype_bytes: int) -> LayerGroup:
    """Per-layer embeddings (Qwen4-Exp PLE): hashed n-gram embeddings (a lookup) projected to one key per residual
    stream and a value (`2 E (s h + h)`), a dilated depthwise conv over the `s h` gated streams. Its state: the
    conv's last `(K - 1) dilation` inputs and the `dilation - 1` previous token ids (the n-gram context, int64)."""
    width = streams * hidden
    state = width * (conv_kernel - 1) * dilation * dtype_bytes + (dilation - 1) * TOKEN_ID_BYTES
    dims = dims_of(hidden=hidden, streams=streams, embed_dim=embed_dim, conv_kernel=conv_kernel, dilation=dilation)
    return LayerGroup("ple", count, 2 * embed_dim * (width + hidden) + 2 * width * conv_kernel, state_bytes=state,
                      dims=dims)


def gated_residual_layers(count: int, hidden: int, streams: int, rank: int, inject: bool = True) -> LayerGroup:
    """Qwen4-Exp's hyper-connections (Qwen4ExpTextGatedResidual): the `streams` residual streams mixed through a
    rank-`rank` bottleneck (`4 s h r`), plus the per-stream injection weights (`2 s h s`) where the block's output
    is written back (`inject`)."""
    width = streams * hidden
    dims = dims_of(hidden=hidden, streams=streams, rank=rank)
    return LayerGroup("hyper_connection", count, 4 * width * rank + (2 * width * streams if inject else 0), dims=dims)


def lightning_layers(count: int, hidden: int, num_heads: int, head_dim: int, dtype_bytes: int) -> LayerGroup:
    """MiniMax lightning attention: a linear attention with a per-head constant decay and no conv. qkv_proj
    (`2 h 3 H d`), the sigmoid output gate (`2 h H d`) and out_proj (`2 H d h`); per token the state update
    `S = e^-s S + k^T v` and the read `q S` (`4 H d^2`). The state, the decayed K^T V sum `H d d`, is kept in the
    model's dtype (the values')."""
    inner = num_heads * head_dim
    flops = 2 * hidden * 3 * inner + 2 * hidden * inner + 2 * inner * hidden + 4 * inner * head_dim
    return LayerGroup("lightning", count, flops, state_bytes=inner * head_dim * dtype_bytes,
                      dims=dims_of(hidden=hidden, heads=num_heads, head_dim=head_dim))
