"""The input of Hydragen attention: shared KV levels forming a tree, per-sequence suffixes, and their validation.

A batch of B sequences is described by
- `levels`: runs of tokens whose KV several sequences share, each `SharedLevel(keys, values, parent)` with
  keys/values of shape (kv_heads, length, head_dim) and `parent` the index of the level it continues (None: a root);
- `seq_levels`: for each sequence, the deepest level of its shared prefix (-1: none). A sequence sees that level and
  all its ancestors, in full: they precede every token of the sequence's suffix;
- `suffix_keys`/`suffix_values` (B, kv_heads, S, head_dim): each sequence's own tokens after its shared prefix;
- queries (B, q_heads, Tq, head_dim): the last Tq suffix slots. By default query t sees suffix slots <= S - Tq + t
  (causal); an explicit `suffix_mask` (B, Tq, S) of booleans replaces that rule (padding, ragged suffixes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixlab.errors import InvalidInputError, is_int


@dataclass(frozen=True)
class SharedLevel:
    """KV of a run of tokens shared by every sequence below it: keys/values (kv_heads, length, head_dim)."""

    keys: torch.Tensor
    values: torch.Tensor
    parent: int | None = None

    @property
    def length(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class TreePlan:
    """A validated batch layout: which sequences see which level, and the suffix visibility."""

    levels: tuple[SharedLevel, ...]
    seq_levels: tuple[int, ...]  # deepest level of each sequence, -1: none
    visible: torch.Tensor  # (batch, n_levels) bool: level n is on sequence b's shared prefix
    members: tuple[torch.Tensor, ...]  # per level: sorted int64 indices of the sequences that see it
    suffix_mask: torch.Tensor | None  # (batch, Tq, S) bool, or None for plain causal

    @property
    def batch_size(self) -> int:
        return self.visible.shape[0]

    def shared_levels(self) -> list[tuple[int, SharedLevel, torch.Tensor]]:
        """(index, level, members) for levels that hold tokens and are seen by at least one sequence."""
        return [
            (n, level, members)
            for n, (level, members) in enumerate(zip(self.levels, self.members, strict=True))
            if level.length > 0 and members.numel() > 0
        ]


def _check_tensor(name: str, tensor: object, ndim: int, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise InvalidInputError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype != like.dtype or tensor.device != like.device:
        raise InvalidInputError(
            f"{name} is {tensor.dtype} on {tensor.device} but the queries are {like.dtype} on {like.device}; "
            "convert every tensor to the queries' dtype and device"
        )
    return tensor


def ancestors_of(parents: Sequence[int | None]) -> list[list[int]]:
    """For each level, its path from the root (root first); raises if the parent links do not form a forest."""
    n = len(parents)
    for i, parent in enumerate(parents):
        if parent is not None and (not is_int(parent) or not 0 <= parent < n or parent == i):  # (not a bool)
            raise InvalidInputError(
                f"levels[{i}].parent={parent!r} must be None or the index of another level in [0, {n})"
            )
    paths: list[list[int]] = []
    for i in range(n):
        path, node = [], i
        while node is not None:
            if node in path:
                raise InvalidInputError(
                    f"levels[{i}] parent links form a cycle through level {node}; they must form a tree"
                )
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def suffix_mask_from_lengths(lengths: Sequence[int] | torch.Tensor, queries: int, slots: int) -> torch.Tensor:
    """Causal visibility (B, Tq, S) for right-aligned suffixes of `lengths` valid slots (the rest is padding)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    slot = torch.arange(slots)
    query_slot = slots - queries + torch.arange(queries)
    causal = slot[None, :] <= query_slot[:, None]  # (Tq, S)
    valid = slot[None, :] >= slots - lengths[:, None]  # (B, S)
    return causal[None] & valid[:, None, :]


def check_levels(levels: Sequence[SharedLevel], kv_heads: int, head_dim: int, like: torch.Tensor) -> None:
    """Every level is a SharedLevel of (kv_heads, length, head_dim) keys/values in `like`'s dtype and device."""
    for i, level in enumerate(levels):
        if not isinstance(level, SharedLevel):
            raise InvalidInputError(f"levels[{i}] must be a SharedLevel, got {type(level).__name__}")
        _check_tensor(f"levels[{i}].keys", level.keys, 3, like)
        _check_tensor(f"levels[{i}].values", level.values, 3, like)
        if level.keys.shape != level.values.shape or level.keys.shape[0] != kv_heads or level.keys.shape[2] != head_dim:
            raise InvalidInputError(
                f"levels[{i}] keys {tuple(level.keys.shape)} / values {tuple(level.values.shape)} must both be "
                f"(kv_heads={kv_heads}, length, head_dim={head_dim})"
            )


def level_visibility(
    levels: Sequence[SharedLevel], seq_levels: Sequence[int] | torch.Tensor | None, batch: int,
    device: torch.device | None = None,
) -> tuple[list[int], torch.Tensor, tuple[torch.Tensor, ...]]:
    """(seq_levels as ints, visible (batch, n_levels) bool, members: per level the sorted int64 indices of the
    sequences that see it), the tensors on `device` (default CPU) and shared between calls: do not modify them."""
    paths = ancestors_of([level.parent for level in levels])
    if seq_levels is None:
        seq_levels = [len(levels) - 1] * batch
    given = seq_levels.reshape(-1).tolist() if isinstance(seq_levels, torch.Tensor) else seq_levels
    if isinstance(given, torch.Tensor | str) or not all(is_int(x) for x in given):  # (0.7 read as 0, True as 1)
        raise InvalidInputError(f"seq_levels must hold int level indices (or -1: none), got {seq_levels!r}")
    seq_levels = [int(x) for x in given]
    if len(seq_levels) != batch:
        raise InvalidInputError(
            f"seq_levels has {len(seq_levels)} entries for a batch of {batch}: give one per sequence"
        )
    if any(not -1 <= leaf < len(levels) for leaf in seq_levels):
        raise InvalidInputError(f"seq_levels={seq_levels} must hold level indices in [0, {len(levels)}) or -1 (none)")
    visible, members = _visible(tuple(map(tuple, paths)), tuple(seq_levels), torch.device(device or "cpu"))
    return seq_levels, visible, members


@functools.lru_cache(maxsize=16)
def _visible(paths: tuple[tuple[int, ...], ...], seq_levels: tuple[int, ...], device: torch.device):
    """`level_visibility`'s tensors for levels' root paths and each sequence's deepest level. Cached: every attention
    layer of a forward asks for the same ones (their KV differ, not who sees what), and on CUDA each fresh answer
    costs host-to-device copies."""
    # one row per level (its path from the root) and a last, empty row that index -1 (no shared prefix) reads:
    # a gather, not a Python loop over the batch (that loop cost ~2 ms of host time a call at B=512)
    on_path = torch.zeros(len(paths) + 1, len(paths), dtype=torch.bool)
    for leaf, path in enumerate(paths):
        on_path[leaf, list(path)] = True
    visible = on_path[torch.tensor(seq_levels, dtype=torch.int64)]
    members = tuple(visible[:, n].nonzero().flatten().to(device) for n in range(len(paths)))
    return visible.to(device), members


def plan_tree(
    q: torch.Tensor,
    levels: Sequence[SharedLevel],
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    seq_levels: Sequence[int] | torch.Tensor | None = None,
    suffix_mask: torch.Tensor | None = None,
    suffix_lengths: Sequence[int] | torch.Tensor | None = None,
) -> TreePlan:
    """Validate a Hydragen batch (see the module docstring) and precompute who sees what."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4:
        raise InvalidInputError(f"q must be a (batch, q_heads, queries, head_dim) tensor, got {getattr(q, 'shape', q)}")
    batch, q_heads, queries, head_dim = q.shape
    _check_tensor("suffix_keys", suffix_keys, 4, q)
    _check_tensor("suffix_values", suffix_values, 4, q)
    if suffix_keys.shape != suffix_values.shape:
        raise InvalidInputError(
            f"suffix_keys {tuple(suffix_keys.shape)} and suffix_values {tuple(suffix_values.shape)} must have one shape"
        )
    s_batch, kv_heads, slots, s_dim = suffix_keys.shape
    if s_batch != batch:
        raise InvalidInputError(f"suffix_keys has batch {s_batch} but q has batch {batch}: one suffix per sequence")
    if s_dim != head_dim:
        raise InvalidInputError(f"suffix_keys head_dim {s_dim} differs from q head_dim {head_dim}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise InvalidInputError(
            f"q has {q_heads} heads and the KV {kv_heads}: the query heads must be a multiple of the KV heads (GQA)"
        )
    if queries > slots:
        raise InvalidInputError(
            f"q has {queries} queries but the suffix only {slots} slots: the queries are the last suffix tokens, "
            "so append the new tokens' keys/values to the suffix first"
        )
    check_levels(levels, kv_heads, head_dim, q)
    seq_levels, visible, members = level_visibility(levels, seq_levels, batch, q.device)

    if suffix_lengths is not None:
        if suffix_mask is not None:
            raise InvalidInputError("give suffix_mask or suffix_lengths, not both")
        try:
            lengths_t = torch.as_tensor(suffix_lengths).reshape(-1)
        except (TypeError, ValueError, RuntimeError):  # (strings, ragged lists: torch's own message)
            raise InvalidInputError(f"suffix_lengths must be integers, got {suffix_lengths!r}") from None
        if lengths_t.is_floating_point() or lengths_t.is_complex() or lengths_t.dtype == torch.bool:
            raise InvalidInputError(f"suffix_lengths must be integers, got {lengths_t.tolist()} ({lengths_t.dtype})")
        if lengths_t.numel() != batch:
            raise InvalidInputError(f"suffix_lengths has {lengths_t.numel()} entries for a batch of {batch}")
        if bool(((lengths_t < queries) | (lengths_t > slots)).any()):
            raise InvalidInputError(
                f"suffix_lengths={lengths_t.tolist()} must lie in [queries={queries}, slots={slots}]"
            )
        suffix_mask = suffix_mask_from_lengths(lengths_t, queries, slots).to(q.device)
    elif suffix_mask is not None:
        if not isinstance(suffix_mask, torch.Tensor) or suffix_mask.dtype != torch.bool:
            raise InvalidInputError("suffix_mask must be a bool tensor (batch, queries, suffix slots)")
        if tuple(suffix_mask.shape) != (batch, queries, slots):
            raise InvalidInputError(
                f"suffix_mask has shape {tuple(suffix_mask.shape)}, expected (batch, queries, slots) = "
                f"{(batch, queries, slots)}"
            )
        if suffix_mask.device != q.device:
            raise InvalidInputError(f"suffix_mask is on {suffix_mask.device} but q on {q.device}")
    return TreePlan(tuple(levels), tuple(seq_levels), visible, members, suffix_mask)
