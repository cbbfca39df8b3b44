"""Finding the KV that rows of a batch share, by bitwise equality, so it can be stored once without changing a bit.

Rows whose tokens and positions agree up to t usually produce bit-identical KV up to t (causal models), e.g. the N
copies `generate(num_return_sequences=N)` makes of a prompt, or prompts that start with one system prompt. Whether
they do depends on the kernels (a BLAS may round a row differently by its place in the batch), so sharing is decided
on the bits the model produced, never by floating-point arithmetic on them: float equality would merge -0.0 with 0.0
and split identical NaNs, and a float signature (a dot product) is not guaranteed to be the same for identical rows.
"""

from __future__ import annotations

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """`x` reinterpreted (not converted) as integers of the same width: equal elements <=> equal bits."""
    return x.view(_SAME_WIDTH_INT[x.element_size()]) if x.is_floating_point() else x


def _equal_to_first_row(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (T,) bool: column t is bit-identical in every row."""
    bits = as_bits(x)
    return (bits == bits[:1]).all(dim=3).all(dim=1).all(dim=0)


def common_prefix_length(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Number of leading tokens whose keys and values are bit-identical in every row of (B, H, T, D)."""
    same = _equal_to_first_row(keys) & _equal_to_first_row(values)
    differs = (~same).nonzero()
    return int(differs[0, 0]) if differs.numel() else keys.shape[2]


def _row_labels(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,) int64: equal labels <=> bit-identical rows (an exact sort of the rows' bits, no hashing)."""
    rows = as_bits(x).reshape(x.shape[0], -1)
    if not rows.shape[1]:
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return torch.unique(rows, dim=0, return_inverse=True)[1]


def identical_row_groups(keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """Rows of (B, H, T, D) grouped by bitwise equality of their keys and values, in order of first row."""
    labels = _row_labels(torch.stack([_row_labels(keys), _row_labels(values)], dim=1))
    groups: dict[int, list[int]] = {}
    for row, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(row)
    return [torch.tensor(rows, dtype=torch.long, device=keys.device) for rows in groups.values()]
