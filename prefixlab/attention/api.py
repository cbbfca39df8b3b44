"""`hydragen_attention`: exact attention for a batch whose KV is a tree of shared levels plus per-sequence suffixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from prefixlab.attention.packed import packed_tree_attention
from prefixlab.attention.reference import reference_attention, suffix_visibility
from prefixlab.attention.split import split_attention
from prefixlab.attention.tree import SharedLevel, TreePlan, plan_tree
from prefixlab.errors import InvalidInputError, check_scale

Method = Literal["auto", "split", "packed", "sdpa"]
METHODS = ("auto", "split", "packed", "sdpa")

# Measured (benchmarks/RESULTS.md, "Hydragen" and "GPU"): on CPU the split path's fused flash kernel beat compiled
# FlexAttention in every case swept (one level or many small ones, B 4..64); on an H200 (bf16, P=16,384) packed ran
# at 0.16-0.35x SDPA where split ran at 1.7-1.9x, and inductor failed to compile its decoding template at B=64. So
# "auto" splits everywhere; packed stays available by name (one launch for a whole tree) until a GPU run shows a
# shape where it wins. Since session 27 split's calls run cuDNN's fused kernel on CUDA: 13.7x SDPA at B=1024 (19.8x
# in a CUDA graph).


def choose_method(q: torch.Tensor, plan: TreePlan) -> str:
    """The implementation `method="auto"` runs for this batch: plain SDPA when nothing is shared, else split."""
    return "split" if plan.shared_levels() else "sdpa"


def suffix_sdpa(q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor,
                scale: float | None) -> torch.Tensor:
    """Plain SDPA over the suffixes alone: what Hydragen reduces to when nothing is shared."""
    queries, slots = q.shape[2], suffix_keys.shape[2]
    mask = None
    if plan.suffix_mask is not None or queries > 1:
        mask = suffix_visibility(plan, queries, slots, q.device)[:, None]
    return F.scaled_dot_product_attention(q, suffix_keys, suffix_values, attn_mask=mask, scale=scale, enable_gqa=True)


def hydragen_attention(
    q: torch.Tensor,
    levels: Sequence[SharedLevel],
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    *,
    seq_levels: Sequence[int] | torch.Tensor | None = None,
    suffix_mask: torch.Tensor | None = None,
    suffix_lengths: Sequence[int] | torch.Tensor | None = None,
    scale: float | None = None,
    method: Method = "auto",
) -> torch.Tensor:
    """Attention of q (B, Hq, Tq, D) over shared levels + each sequence's suffix (B, Hkv, S, D) -> (B, Hq, Tq, D).

    Args:
        levels: shared KV runs forming a tree (see `prefixlab.attention.tree`); empty levels are ignored.
        seq_levels: deepest level of each sequence's shared prefix (-1: none); default every sequence below the last.
        suffix_mask: (B, Tq, S) bool visibility of suffix slots; default causal with queries at the last Tq slots.
        suffix_lengths: alternatively, the number of valid (right-aligned) suffix slots per sequence, causal.
        scale: softmax scale, default head_dim ** -0.5.
        method: "split" (prefix batched per level + suffix + LSE combine), "packed" (one FlexAttention call over the
            packed tree), "sdpa" (materialise each sequence's KV: the reference), or "auto" (measured heuristic).
    """
    if method not in METHODS:
        raise InvalidInputError(f"method={method!r} must be one of {METHODS}")
    scale = check_scale(scale, "head_dim ** -0.5")  # (numpy scalars too)
    plan = plan_tree(q, levels, suffix_keys, suffix_values, seq_levels, suffix_mask, suffix_lengths)
    if q.shape[2] == 0:  # no query: nothing to attend (the kernels' shapes cannot hold zero queries)
        return q.new_zeros(q.shape)
    chosen = choose_method(q, plan) if method == "auto" else method
    if not plan.shared_levels() and chosen != "packed":
        return suffix_sdpa(q, plan, suffix_keys, suffix_values, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if chosen == "split":
        return split_attention(q, plan, suffix_keys, suffix_values, scale)
    if chosen == "packed":
        return packed_tree_attention(q, plan, suffix_keys, suffix_values, scale)
    return reference_attention(q, plan, suffix_keys, suffix_values, scale)
