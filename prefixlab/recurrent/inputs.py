"""Random but realistic kernel inputs (as the HF layers produce them), for tests and benchmarks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def delta_rule_inputs(
    batch: int,
    length: int,
    heads_k: int,
    heads_v: int,
    dim_k: int,
    dim_v: int,
    *,
    per_channel_decay: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta for gated_delta_rule: g = -exp(A_log) * softplus(a + dt_bias) like GatedDeltaNet (per key
    channel for KDA), beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    decay_shape = (batch, length, heads_v) + ((dim_k,) if per_channel_decay else ())
    raw_decay = torch.randn(decay_shape, generator=gen)
    rate = torch.empty(decay_shape[2:]).uniform_(0.01, 1.0, generator=gen)
    tensors = {
        "q": torch.randn(batch, length, heads_k, dim_k, generator=gen),
        "k": torch.randn(batch, length, heads_k, dim_k, generator=gen),
        "v": torch.randn(batch, length, heads_v, dim_v, generator=gen),
        "g": -rate * F.softplus(raw_decay - 2.0),
        "beta": torch.randn(batch, length, heads_v, generator=gen).sigmoid(),
    }
    return {name: t.to(dtype) for name, t in tensors.items()}


def ssd_inputs(
    batch: int,
    length: int,
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """x, dt, A, B, C, D, dt_bias for ssd, with Mamba2's initialisation ranges (A in [-heads, -1], dt ~ 1e-3..1e-1)."""
    gen = torch.Generator().manual_seed(seed)
    dt_init = torch.exp(torch.rand(heads, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    tensors = {
        "x": torch.randn(batch, length, heads, head_dim, generator=gen),
        "dt": torch.randn(batch, length, heads, generator=gen),
        "A": -torch.arange(1, heads + 1, dtype=torch.float32),
        "B": torch.randn(batch, length, groups, state_size, generator=gen) / state_size**0.5,
        "C": torch.randn(batch, length, groups, state_size, generator=gen) / state_size**0.5,
        "D": torch.ones(heads),
        "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus, as Mamba2 initialises it
    }
    return {name: t.to(dtype) for name, t in tensors.items()}


def random_state(*shape: int, seed: int = 1) -> torch.Tensor:
    """A float32 recurrent state of moderate magnitude (what a real prefix leaves behind)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5
