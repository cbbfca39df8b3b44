"""Finding the KV that rows of a batch share, by bitwise equality, so it can be stored once without changing a bit.

Rows whose tokens and positions agree up to t produce bit-identical KV up to t (causal models), e.g. the N copies
`generate(num_return_sequences=N)` makes of a prompt, or prompts that start with one system prompt.
"""

from __future__ import annotations

import torch


def _equal_to_first_row(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (T,) bool: column t is bit-identical in every row."""
    return (x == x[:1]).all(dim=3).all(dim=1).all(dim=0)


def common_prefix_length(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Number of leading tokens whose keys and values are identical in every row of (B, H, T, D)."""
    same = _equal_to_first_row(keys) & _equal_to_first_row(values)
    differs = (~same).nonzero()
    return int(differs[0, 0]) if differs.numel() else keys.shape[2]


def identical_row_groups(keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """Rows of (B, H, T, D) grouped by bitwise equality of their keys and values, in order of first row.

    A random projection proposes groups in one pass (equal rows get equal signatures: same ops, same inputs);
    each member is then checked bit for bit against its group's first row, so a collision can only split a group.
    """
    batch = keys.shape[0]
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(keys[0].numel(), generator=generator, dtype=torch.float64).to(keys.device)
    signature = torch.stack([keys.reshape(batch, -1).double() @ probe, values.reshape(batch, -1).double() @ probe], 1)
    _, proposal = torch.unique(signature, dim=0, return_inverse=True)
    groups: list[torch.Tensor] = []
    for label in proposal.unique(sorted=False).tolist():
        rows = (proposal == label).nonzero().flatten()
        while rows.numel():
            first = rows[0]
            same = (keys[rows] == keys[first]).flatten(1).all(1) & (values[rows] == values[first]).flatten(1).all(1)
            groups.append(rows[same])
            rows = rows[~same]
    return sorted(groups, key=lambda rows: int(rows[0]))
