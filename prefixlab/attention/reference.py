"""The reference Hydragen must equal: SDPA over each sequence's full KV, materialised as a standard cache holds it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefixlab.attention.tree import SharedLevel, TreePlan, ancestors_of


def causal_suffix_mask(queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """(Tq, S) bool: query t, the suffix slot S - Tq + t, sees slots up to itself."""
    slot = torch.arange(slots, device=device)
    return slot[None, :] <= (slots - queries + torch.arange(queries, device=device))[:, None]


def suffix_visibility(plan: TreePlan, queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """(B, Tq, S) bool visibility of the suffix slots, explicit or causal."""
    if plan.suffix_mask is not None:
        return plan.suffix_mask
    return causal_suffix_mask(queries, slots, device).expand(plan.batch_size, queries, slots)


def materialize_rows(
    levels: Sequence[SharedLevel], seq_levels: Sequence[int], suffix_keys: torch.Tensor, suffix_values: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's keys and values (kv_heads, prefix + S, D): its shared levels root first, then its suffix."""
    paths = ancestors_of([level.parent for level in levels])
    rows = []
    for b, leaf in enumerate(seq_levels):
        path = paths[leaf] if leaf >= 0 else []
        rows.append((torch.cat([levels[n].keys for n in path] + [suffix_keys[b]], dim=1),
                     torch.cat([levels[n].values for n in path] + [suffix_values[b]], dim=1)))
    return rows


def reference_attention(
    q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Hydragen's result computed the plain way: one SDPA call per sequence over its materialised KV."""
    _, _, queries, _ = q.shape
    slots = suffix_keys.shape[2]
    visible = suffix_visibility(plan, queries, slots, q.device)
    outs = []
    rows = materialize_rows(plan.levels, plan.seq_levels, suffix_keys, suffix_values)
    for b, (keys, values) in enumerate(rows):
        prefix = keys.shape[1] - slots
        mask = torch.cat([visible.new_ones(queries, prefix), visible[b]], dim=1)
        outs.append(
            F.scaled_dot_product_attention(q[b : b + 1], keys[None], values[None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        )
    return torch.cat(outs, dim=0)
