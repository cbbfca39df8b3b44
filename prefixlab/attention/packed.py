"""Packed-tree Hydragen: ONE FlexAttention call over every tree node's KV, concatenated, with a block mask.

KV axis: [level 0 | level 1 | ... | suffix of sequence 0 | suffix of sequence 1 | ...]; query axis: the queries of
sequence 0, then 1, ... Every token gets an owner (its node: a level, or a sequence's suffix) and a position inside
its sequence; a query sees a key iff the key's owner is on the query's path and the key does not come after it.
Blocks of keys no query of a block can see are skipped, so a shared level is read once per query block that needs
it, and prompts of different lengths are prefilled packed, without padding (`varlen_prefill_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixlab.attention.reference import suffix_visibility
from prefixlab.attention.tree import SharedLevel, TreePlan, _check_tensor, check_levels, level_visibility
from prefixlab.compile import compile_or_eager
from prefixlab.errors import InvalidInputError, check_scale


@dataclass(frozen=True)
class PackedLayout:
    """Who is who on the packed axes. Owners 0..n_levels-1 are levels, n_levels + b is sequence b's suffix."""

    query_seq: torch.Tensor  # (Nq,) int: the sequence of each packed query
    query_slot: torch.Tensor  # (Nq,) int: its suffix slot (the key it is the query of)
    key_owner: torch.Tensor  # (Nk,) int
    key_slot: torch.Tensor  # (Nk,) int: suffix slot for suffix keys, -1 for level keys (seen whole)
    owner_visible: torch.Tensor  # (B, n_owners) bool: the nodes on each sequence's path, its own suffix included
    suffix_visible: torch.Tensor | None  # (B, Tq, S) bool explicit suffix visibility, None = causal by slot

    def mask_mod(self):
        """FlexAttention mask_mod: query q sees key k iff k's owner is on q's path and k's slot is visible to q."""
        query_seq, query_slot = self.query_seq, self.query_slot
        key_owner, key_slot, owner_visible = self.key_owner, self.key_slot, self.owner_visible
        explicit = self.suffix_visible
        queries = explicit.shape[1] if explicit is not None else 0

        def mask_mod(b, h, q_idx, kv_idx):
            seq, slot = query_seq[q_idx], key_slot[kv_idx]
            on_path = owner_visible[seq, key_owner[kv_idx]]
            if explicit is None:
                return on_path & (slot <= query_slot[q_idx])
            suffix_ok = explicit[seq, q_idx % queries, slot.clamp(min=0)]
            return on_path & ((slot < 0) | suffix_ok)

        return mask_mod


def tree_layout(
    visible: torch.Tensor, level_lengths: list[int], suffix_lengths: list[int], query_counts: list[int],
    suffix_visible: torch.Tensor | None = None,
) -> PackedLayout:
    """Layout of [levels | suffix of sequence 0 | suffix of 1 | ...] keys and each sequence's queries, which are
    the last `query_counts[b]` of its `suffix_lengths[b]` suffix tokens. `visible` (B, n_levels): levels on paths."""
    device = visible.device
    batch, n_levels = visible.shape
    seqs = torch.arange(batch, device=device)
    suffix_lengths_t = torch.tensor(suffix_lengths, device=device)
    query_counts_t = torch.tensor(query_counts, device=device)
    slots = [torch.arange(n, device=device) for n in suffix_lengths]
    return PackedLayout(
        query_seq=seqs.repeat_interleave(query_counts_t),
        query_slot=torch.cat([s[n - m :] for s, n, m in zip(slots, suffix_lengths, query_counts, strict=True)]),
        key_owner=torch.cat([torch.arange(n_levels, device=device).repeat_interleave(
            torch.tensor(level_lengths, dtype=torch.int64, device=device)), (n_levels + seqs).repeat_interleave(
            suffix_lengths_t)]),
        key_slot=torch.cat([torch.full((sum(level_lengths),), -1, device=device), *slots]),
        owner_visible=torch.cat([visible, torch.eye(batch, dtype=torch.bool, device=device)], dim=1),
        suffix_visible=suffix_visible,
    )


def pack_batch(q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor):
    """(q (1, Hq, B*Tq, D), k, v (1, Hkv, sum L + B*S, D), layout) for a padded Hydragen batch."""
    batch, q_heads, queries, dim = q.shape
    kv_heads, slots = suffix_keys.shape[1], suffix_keys.shape[2]
    explicit = None if plan.suffix_mask is None else suffix_visibility(plan, queries, slots, q.device)
    layout = tree_layout(plan.visible, [level.length for level in plan.levels], [slots] * batch, [queries] * batch,
                         explicit)
    keys = [level.keys for level in plan.levels] + [suffix_keys.transpose(0, 1).reshape(kv_heads, batch * slots, dim)]
    values = [level.values for level in plan.levels] + [
        suffix_values.transpose(0, 1).reshape(kv_heads, batch * slots, dim)
    ]
    q_packed = q.transpose(0, 1).reshape(1, q_heads, batch * queries, dim)
    return q_packed, torch.cat(keys, dim=1)[None], torch.cat(values, dim=1)[None], layout


CPU_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what inductor's CPU flex template builds


@functools.cache
def _compiled_flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # CUDA: automatic dynamic shapes (a decode loop's growing suffix recompiles once, not every step). CPU: static,
    # since torch 2.13's C++ flex template fails to build once both the query and key lengths are dynamic
    # (tests/test_hydragen_attention.py), and checked against eager flex once per shape, since in AVX2 code it
    # returns wrong values at some small shapes (tests/test_compile.py); "auto" never picks this path on CPU
    return compile_or_eager(flex_attention, "FlexAttention (packed Hydragen)",
                            dynamic=False if device_type == "cpu" else None, check_devices=("cpu",))


def packed_compile_failed(device_type: str) -> bool:
    """Whether the packed path's FlexAttention failed to compile on this device type (it then runs eagerly)."""
    return bool(_compiled_flex(device_type).compile_failed)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float, compiled: bool = True
) -> torch.Tensor:
    """One FlexAttention call over packed q (1, Hq, Nq, D) and k/v (1, Hkv, Nk, D) under `layout`."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled and q.device.type == "cpu" and q.dtype not in CPU_FLEX_DTYPES:
        raise InvalidInputError(f"compiled FlexAttention on CPU takes float32, float16 or bfloat16, not {q.dtype}: "
                                "use method='split' (or 'sdpa') for this dtype")
    block_mask = create_block_mask(layout.mask_mod(), None, None, q.shape[2], k.shape[2], device=q.device)
    attend = _compiled_flex(q.device.type) if compiled else flex_attention
    return attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def packed_tree_attention(
    q: torch.Tensor, plan: TreePlan, suffix_keys: torch.Tensor, suffix_values: torch.Tensor, scale: float,
    compiled: bool = True,
) -> torch.Tensor:
    """Exact attention of q (B, Hq, Tq, D) over shared levels + suffixes in one FlexAttention call."""
    batch, q_heads, queries, dim = q.shape
    q_packed, k_packed, v_packed, layout = pack_batch(q, plan, suffix_keys, suffix_values)
    out = packed_attention(q_packed, k_packed, v_packed, layout, scale, compiled)
    return out.reshape(q_heads, batch, queries, dim).transpose(0, 1)


def varlen_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], levels: Sequence[SharedLevel] = (),
    seq_levels: Sequence[int] | None = None, scale: float | None = None, compiled: bool = True,
) -> torch.Tensor:
    """Causal prefill of prompts of different lengths packed WITHOUT padding (flash-attn varlen style), each after
    its shared levels: q (N, Hq, D), k/v (N, Hkv, D) with N = sum(lengths) tokens, sequence after sequence."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, tensor, 3, q)
    if k.shape[2] != q.shape[2]:
        raise InvalidInputError(f"k head_dim {k.shape[2]} differs from q head_dim {q.shape[2]}")
    given = torch.as_tensor(lengths).reshape(-1)
    if given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
        raise InvalidInputError(f"lengths={given.tolist()} must be integers (tokens per sequence)")
    lengths = given.tolist()
    if sum(lengths) != q.shape[0] or k.shape[0] != q.shape[0] or v.shape != k.shape or min(lengths, default=1) < 1:
        raise InvalidInputError(
            f"lengths={list(lengths)} must be positive and sum to the packed token count of q/k/v ({q.shape[0]})"
        )
    if q.shape[1] % k.shape[1]:
        raise InvalidInputError(f"q has {q.shape[1]} heads, k {k.shape[1]}: a multiple is needed (GQA)")
    check_levels(levels, k.shape[1], k.shape[2], q)
    _, visible, _ = level_visibility(levels, seq_levels, len(lengths), q.device)
    layout = tree_layout(visible, [level.length for level in levels], list(lengths), list(lengths))
    keys = torch.cat([level.keys for level in levels] + [k.transpose(0, 1)], dim=1)[None]
    values = torch.cat([level.values for level in levels] + [v.transpose(0, 1)], dim=1)[None]
    scale = check_scale(scale, "head_dim ** -0.5")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = packed_attention(q.transpose(0, 1)[None], keys, values, layout, scale, compiled)
    return out[0].transpose(0, 1)
