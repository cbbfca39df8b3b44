"""The reference Hydragen must equal: SDPA over each sequence's full KV, materialised as a standard cache holds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixlab.attention.tree import TreePlan, ancestors_of


def causal_suffix_mask(queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """(Tq, S) bool: query t, the suffix slot S - Tq + t, sees slots up to itself."""
    slot = torch.arange(slots, device=device)
    return slot[None, :] <= (slots - queries + torch.arange(queries, device=device))[:, None]


def suffix_visibility(plan: TreePlan, queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """(B, Tq, S) bool visibility of the suffix slots, explicit or causal."""
    if plan.suffix_mask is not None:
        return plan.suffix_mask
    return causal_suffix_mask(queries, slots, device).expand(plan.batch_size, queries, slots)


def materialize_kv(plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor, b: int):
    """Sequence b's keys and values (kv_heads, prefix + S, D): its shared levels root first, then its suffix."""
    paths = ancestors_of([level.parent for level in plan.levels])
    leaf_path = max((paths[n] for n in range(len(plan.levels)) if plan.visible[b, n]), key=len, default=[])
    keys = [plan.levels[n].keys for n in leaf_path] + [suffix_keys[b]]
    values = [plan.levels[n].values for n in leaf_path] + [suffix_values[b]]
    return torch.cat(keys, dim=1), torch.cat(values, dim=1)


def reference_attention(
    q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Hydragen's result computed the plain way: one SDPA call per sequence over its materialised KV."""
    _, _, queries, _ = q.shape
    slots = suffix_keys.shape[2]
    visible = suffix_visibility(plan, queries, slots, q.device)
    outs = []
    for b in range(plan.batch_size):
        keys, values = materialize_kv(plan, suffix_keys, suffix_values, b)
        prefix = keys.shape[1] - slots
        mask = torch.cat([visible.new_ones(queries, prefix), visible[b]], dim=1)
        outs.append(
            F.scaled_dot_product_attention(q[b : b + 1], keys[None], values[None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        )
    return torch.cat(outs, dim=0)
