"""CUDA backends: fla's chunk_gated_delta_rule and mamba_ssm's mamba_chunk_scan_combined, imported lazily.

Both are driven through their public, long-stable entry points rather than their internals (whose signatures and
state layouts change between releases): the sequence is split at the capture positions and each segment resumes
from the previous segment's final state. A captured state is then by construction the final state of a run over
tokens[:p], and resuming from it is the very computation that produced the later outputs. The cost is one kernel
launch per segment (partial chunks at segment ends), small next to a prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

States = dict[int, torch.Tensor]
Segment = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_in_segments(
    length: int, positions: tuple[int, ...], state: torch.Tensor, run: Segment
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Run `run(start, stop, state) -> (outputs [B, stop - start, ...], final state)` over [0, length) split at
    `positions`; returns the concatenated outputs, the final state and {p: state after p tokens}."""
    wanted = set(positions)
    bounds = sorted(wanted | {0, length})
    captured: States = {}
    outputs = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        if start in wanted:
            captured[start] = state.clone()
        out, state = run(start, stop, state)
        outputs.append(out)
    if length in wanted:
        captured[length] = state.clone()
    return torch.cat(outputs, dim=1), state, captured


def delta_rule_fla(
    q, k, v, g, beta, state, positions, use_qk_l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """[B, T, H, *] fp16 / bf16 inputs (heads expanded), fp32 state -> fla's chunked kernel (chunks of 64); a
    one-token segment (a decode step) -> fla's fused recurrent kernel, one launch, as transformers decodes with."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def segment(start: int, stop: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        piece = slice(start, stop)
        kernel = fused_recurrent_gated_delta_rule if stop - start == 1 else chunk_gated_delta_rule
        return kernel(
            # by keyword: the fused recurrent kernel's fifth parameter is gk (per-channel decay), not beta
            q[:, piece], k[:, piece], v[:, piece], g=g[:, piece], beta=beta[:, piece],
            scale=scale, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        )  # fmt: skip

    return run_in_segments(q.shape[1], positions, state, segment)


def ssd_mamba_ssm(
    x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state, positions, chunk_size
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """ssd's contract on mamba_ssm's Triton kernels (raw inputs: mamba_ssm applies dt_bias, softplus, limit, D)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    batch, length, heads, head_dim = x.shape
    if initial_state is None:
        initial_state = x.new_zeros(batch, heads, head_dim, B.shape[-1], dtype=torch.float32)

    def segment(start: int, stop: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        piece = slice(start, stop)
        return mamba_chunk_scan_combined(
            x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], chunk_size, D=D, dt_bias=dt_bias,
            initial_states=initial, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=True,
        )  # fmt: skip

    y, final, captured = run_in_segments(length, positions, initial_state.to(torch.float32), segment)
    return y.to(x.dtype), final.to(torch.float32), {p: s.to(torch.float32) for p, s in captured.items()}
