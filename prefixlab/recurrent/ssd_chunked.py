"""Chunked Mamba2 SSD in torch, with exact states at any position.

Same decomposition as transformers' torch path and mamba_ssm (intra-chunk "attention" with the decay mask, per-chunk
state writes, a scan over chunk states, then each token reads its chunk's start state), except that the scan over
chunks is a linear loop of elementwise ops instead of an O(num_chunks^2) einsum.
"""

from __future__ import annotations

import torch

from prefixlab.recurrent._chunks import (
    chunked,
    cumulative_log_decay,
    decayed_scores,
    in_cpu_blocks,
    needs_grad,
    states_at_positions,
    unchunked,
)
from prefixlab.recurrent.dispatch import compiled

States = dict[int, torch.Tensor]


def ssd_intra_chunk(x, dt, A, B, C, chunk_size: int):
    """The parallel part on prepared [B, T, H, *] inputs. Returns per-chunk tensors [N, B, H, L, *]:
    y_diag (intra-chunk outputs), chunk_writes [N, B, H, P, S] (what each chunk adds to the state, decayed to its
    end), chunk_decay [N, B, H, 1], C_decayed, log_decay_cum [N, B, H, L, 1], x*dt and B."""
    x_dt, B, C = (chunked(t, chunk_size) for t in (x * dt[..., None], B, C))
    log_decay_cum = cumulative_log_decay(chunked(dt * A, chunk_size)[..., None])
    y_diag = decayed_scores(C, B, log_decay_cum) @ x_dt
    to_end = (log_decay_cum[..., -1:, :] - log_decay_cum).exp()
    chunk_writes = x_dt.transpose(-1, -2) @ (B * to_end)
    chunk_decay = log_decay_cum[..., -1, :].exp()
    C_decayed = C * log_decay_cum.exp()
    return y_diag, chunk_writes, chunk_decay, C_decayed, log_decay_cum, x_dt, B


def scan_chunk_states(chunk_writes, chunk_decay, state):
    """Chunk-start states [N, B, H, P, S] and the final state: in one preallocated buffer without autograd, as
    stacked fresh tensors with it (autograd cannot follow out= writes into a shared buffer)."""
    num_chunks = chunk_writes.shape[0]
    decay = chunk_decay[..., None]
    if needs_grad(chunk_writes, decay, state):
        starts = [state]
        for c in range(num_chunks):
            starts.append(starts[c] * decay[c] + chunk_writes[c])
        starts = torch.stack(starts)
    else:
        starts = state.new_empty(num_chunks + 1, *state.shape)
        starts[0] = state
        for c in range(num_chunks):
            torch.mul(starts[c], decay[c], out=starts[c + 1])
            starts[c + 1] += chunk_writes[c]
    return starts[:-1], starts[-1].clone()


def ssd_outputs(y_diag, C_decayed, starts, length: int) -> torch.Tensor:
    """y [B, T, H, P] without the D skip."""
    return unchunked(y_diag + C_decayed @ starts.transpose(-1, -2), length)


def _run(x, dt, A, B, C, state, positions, chunk_size, use_compile: bool):
    # batch rows and heads are independent: on the CPU they go through in cache-sized blocks (_chunks.cpu_blocks)
    def run_block(x, dt, B, C, state, A):
        return _run_block(x, dt, A, B, C, state, positions, chunk_size, use_compile)

    return in_cpu_blocks(run_block, (x, dt, B, C), state, max(x.shape[-1], B.shape[-1], chunk_size), per_head=(A,))


def _run_block(x, dt, A, B, C, state, positions, chunk_size, use_compile: bool):
    prepare, output = (ssd_intra_chunk, ssd_outputs)
    if use_compile:
        prepare, output = compiled(prepare), compiled(output)
    y_diag, chunk_writes, chunk_decay, C_decayed, log_decay_cum, x_dt, B_chunks = prepare(x, dt, A, B, C, chunk_size)
    starts, final = scan_chunk_states(chunk_writes, chunk_decay, state)
    y = output(y_diag, C_decayed, starts, x.shape[1])
    captured = states_at_positions(positions, starts, final, log_decay_cum, x_dt, B_chunks, x.shape[1])
    return y, final, captured


def ssd_chunked(x, dt, A, B, C, state, positions, chunk_size) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Chunked SSD on prepared inputs; same contract as ssd_naive."""
    return _run(x, dt, A, B, C, state, positions, chunk_size, use_compile=False)


def ssd_compiled(x, dt, A, B, C, state, positions, chunk_size) -> tuple[torch.Tensor, torch.Tensor, States]:
    """ssd_chunked with its parallel parts through torch.compile (the chunk loop stays eager)."""
    return _run(x, dt, A, B, C, state, positions, chunk_size, use_compile=True)
