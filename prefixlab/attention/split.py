"""Split Hydragen: each shared level attended once by all its sequences' queries, suffixes per sequence, LSE merge.

For a level shared by m sequences, the m * q_heads/kv_heads * Tq queries that read it are folded into the query
axis of ONE attention call against the level's (kv_heads, L, D) keys: the shared KV is read once and the work is a
matrix-matrix product instead of m matrix-vector ones (the point of Hydragen).
"""

from __future__ import annotations

import torch

from prefixlab.attention.kernels import attention_with_lse, combine_partials, compiled_combine, fold_grouped_queries
from prefixlab.attention.reference import causal_suffix_mask
from prefixlab.attention.tree import TreePlan


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(m, Hq, Tq, D) -> (1, Hkv, m * G * Tq, D): every query that reads a KV head, as one long query axis."""
    m, q_heads, queries, dim = q.shape
    group = q_heads // kv_heads
    return q.view(m, kv_heads, group, queries, dim).transpose(0, 1).reshape(1, kv_heads, m * group * queries, dim)


def unfold_queries(x: torch.Tensor, m: int, q_heads: int) -> torch.Tensor:
    """Inverse of `fold_queries` for outputs (1, Hkv, m*G*Tq, D) or LSEs (1, Hkv, m*G*Tq)."""
    kv_heads, rows = x.shape[1], x.shape[2]
    queries = rows // (m * (q_heads // kv_heads))
    trailing = x.shape[3:]
    x = x.reshape(kv_heads, m, q_heads // kv_heads, queries, *trailing).transpose(0, 1)
    return x.reshape(m, q_heads, queries, *trailing)


def level_partial(q: torch.Tensor, level_keys: torch.Tensor, level_values: torch.Tensor, scale: float):
    """Attention of q (m, Hq, Tq, D) over one shared level (Hkv, L, D): (out, lse) in q's layout."""
    m, q_heads = q.shape[:2]
    out, lse = attention_with_lse(fold_queries(q, level_keys.shape[0]), level_keys[None], level_values[None], None,
                                  scale)
    return unfold_queries(out, m, q_heads), unfold_queries(lse, m, q_heads)


def suffix_partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """Attention of each sequence's queries (B, Hq, Tq, D) over its own suffix (B, Hkv, S, D); mask (B, Tq, S)."""
    batch, q_heads, queries, dim = q.shape
    # GQA: a KV head's query heads share its suffix
    folded, mask = fold_grouped_queries(q, keys.shape[1], None if mask is None else mask[:, None])
    out, lse = attention_with_lse(folded, keys, values, mask, scale)
    return out.reshape(batch, q_heads, queries, dim), lse.reshape(batch, q_heads, queries)


def split_attention(
    q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact attention of q (B, Hq, Tq, D) over shared levels + suffixes, one call per level and one for suffixes."""
    batch, _, queries, _ = q.shape
    slots = suffix_keys.shape[2]
    mask = plan.suffix_mask
    if mask is None and queries > 1:
        mask = causal_suffix_mask(queries, slots, q.device).expand(batch, queries, slots)
    outs, lses = [], []
    for _, level, members in plan.shared_levels():
        everyone = members.numel() == batch
        out, lse = level_partial(q if everyone else q.index_select(0, members), level.keys, level.values, scale)
        if not everyone:  # sequences outside the level see none of it: lse = -inf
            out = q.new_zeros(q.shape).index_copy_(0, members, out)
            lse = lse.new_full((batch, *lse.shape[1:]), float("-inf")).index_copy_(0, members, lse)
        outs.append(out)
        lses.append(lse)
    out, lse = suffix_partial(q, suffix_keys, suffix_values, mask, scale)
    outs.append(out)
    lses.append(lse)
    combine = compiled_combine() if q.device.type == "cuda" else combine_partials
    return combine(torch.stack(outs), torch.stack(lses))
