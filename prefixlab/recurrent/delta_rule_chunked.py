"""Chunked gated delta rule in torch (the CPU / portable fast path), with exact states at any position.

Within a chunk the delta rule's sequential corrections are one unit-lower-triangular solve (the WY / UT form of
DeltaNet); only a [K, V] state crosses chunk boundaries. Compared with transformers' torch_chunk_gated_delta_rule:
one solve for both right-hand sides, and the outputs are computed for all chunks at once after the scan, so the
sequential loop holds only the two matmuls that carry the state.
"""

from __future__ import annotations

import torch

from prefixlab.recurrent._chunks import chunked, decayed_scores, states_at_positions
from prefixlab.recurrent.dispatch import compiled

States = dict[int, torch.Tensor]


def intra_chunk(q, k, v, g, beta, chunk_size: int):
    """The parallel part: per-chunk tensors [B, H, N, C, *] from prepared [B, T, H, *] inputs.

    Returns u, w (the UT-transformed values and decayed keys: a chunk starting in S writes v_new = u - w @ S),
    attn (intra-chunk scores), q_decayed, k_to_end (keys decayed to the chunk end), chunk_decay [B, H, N, 1|K],
    log_decay_cum [B, H, N, C, 1|K] and the chunked keys."""
    q, k, v = (chunked(x.transpose(1, 2), chunk_size) for x in (q, k, v))
    beta = chunked(beta.transpose(1, 2), chunk_size)[..., None]
    g = chunked(g.transpose(1, 2), chunk_size)
    log_decay_cum = (g[..., None] if g.dim() == 4 else g).cumsum(dim=-2)

    k_beta = k * beta
    ut_system = decayed_scores(k_beta, k, log_decay_cum)
    rhs = torch.cat([v * beta, k_beta * log_decay_cum.exp()], dim=-1)
    u, w = torch.linalg.solve_triangular(ut_system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1
    )
    attn = decayed_scores(q, k, log_decay_cum)
    q_decayed = q * log_decay_cum.exp()
    k_to_end = k * (log_decay_cum[..., -1:, :] - log_decay_cum).exp()
    chunk_decay = log_decay_cum[..., -1, :].exp()
    return u, w, attn, q_decayed, k_to_end, chunk_decay, log_decay_cum, k


def scan_chunks(u, w, k_to_end, chunk_decay, state):
    """The sequential part: chunk-start states [B, H, N, K, V], corrected values v_new and the final state."""
    batch, heads = state.shape[:2]
    # Batch and heads flattened so each step is two fused multiply-adds (baddbmm) on [B*H, ...].
    u, w, k_to_end_t = (x.flatten(0, 1) for x in (u, w, k_to_end.transpose(-1, -2)))
    decay = chunk_decay.flatten(0, 1)[..., None]
    state = state.flatten(0, 1)
    starts, corrected = [], []
    for c in range(u.shape[1]):
        starts.append(state)
        v_new = torch.baddbmm(u[:, c], w[:, c], state, alpha=-1)
        corrected.append(v_new)
        state = torch.baddbmm(state * decay[:, c], k_to_end_t[:, c], v_new)
    unflat = (batch, heads)
    return (
        torch.stack(starts, dim=1).unflatten(0, unflat),
        torch.stack(corrected, dim=1).unflatten(0, unflat),
        state.unflatten(0, unflat),
    )


def chunk_outputs(q_decayed, attn, starts, v_new, length: int) -> torch.Tensor:
    """o [B, T, H, V]: each token reads its chunk's start state plus the chunk's earlier tokens."""
    o = q_decayed @ starts + attn @ v_new
    return o.flatten(2, 3)[:, :, :length].transpose(1, 2)


def _run(q, k, v, g, beta, state, positions, chunk_size, use_compile: bool):
    prepare, output = (compiled(intra_chunk), compiled(chunk_outputs)) if use_compile else (intra_chunk, chunk_outputs)
    u, w, attn, q_decayed, k_to_end, chunk_decay, log_decay_cum, k_chunks = prepare(q, k, v, g, beta, chunk_size)
    starts, v_new, final = scan_chunks(u, w, k_to_end, chunk_decay, state)
    o = output(q_decayed, attn, starts, v_new, q.shape[1])
    captured = states_at_positions(positions, starts, final, log_decay_cum, k_chunks, v_new, q.shape[1])
    return o, final, captured


def delta_rule_chunked(q, k, v, g, beta, state, positions, chunk_size) -> tuple[torch.Tensor, torch.Tensor, States]:
    """Chunked kernel on prepared inputs (fp32, heads expanded, q scaled; [B, T, H, *]); same contract as
    delta_rule_naive."""
    return _run(q, k, v, g, beta, state, positions, chunk_size, use_compile=False)


def delta_rule_compiled(q, k, v, g, beta, state, positions, chunk_size) -> tuple[torch.Tensor, torch.Tensor, States]:
    """delta_rule_chunked with its parallel parts through torch.compile (the chunk loop stays eager: it is two
    matmuls per chunk, and unrolling it would recompile for every sequence length)."""
    return _run(q, k, v, g, beta, state, positions, chunk_size, use_compile=True)
