"""Chunked gated delta rule in torch (the CPU / portable fast path), with exact states at any position.

Within a chunk the delta rule's sequential corrections are one unit-lower-triangular system (the WY / UT form of
DeltaNet); only a [K, V] state crosses chunk boundaries. Compared with transformers' torch_chunk_gated_delta_rule:
the [C, C] system is inverted once and applied with matmuls (beta folded into its columns), the outputs of all
chunks are computed at once after the scan, and the scan only does the two matmul-adds that carry the state, in
preallocated chunk-major buffers. q/k normalisation happens here so that torch.compile fuses it with the chunking.
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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's / transformers' l2norm (eps inside the rsqrt)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool, scale: float):
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def intra_chunk(q, k, v, g, beta, chunk_size: int, use_qk_l2norm: bool, scale: float):
    """The parallel part: per-chunk tensors [N, B, H, C, *] from fp32 [B, T, H, *] inputs (heads expanded).

    Returns u, w (a chunk starting in state S writes v_new = u - w @ S), attn (intra-chunk scores), q_decayed,
    k_to_end (keys decayed to the chunk end), chunk_decay [N, B, H, 1|K], log_decay_cum [N, B, H, C, 1|K] and the
    chunked keys."""
    q, k = prepare_qk(q, k, use_qk_l2norm, scale)
    q, k, v, beta, g = (chunked(x, chunk_size) for x in (q, k, v, beta, g))
    log_decay_cum = cumulative_log_decay(g[..., None] if g.dim() == 4 else g)
    beta_cols = beta[..., None, :]  # scales the columns of T

    # T = (I + strictly_lower(diag(beta) K K^T * decay))^-1 by one solve against I (C right-hand sides, not
    # V + K), then [u | w] = T diag(beta) [V | K * exp(G)] in one matmul.
    ut_system = decayed_scores(k, k, log_decay_cum) * beta[..., None]
    eye = torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    inverse = torch.linalg.solve_triangular(ut_system, eye.expand_as(ut_system), upper=False, unitriangular=True)
    uw = (inverse * beta_cols) @ torch.cat([v, k * log_decay_cum.exp()], dim=-1)
    u, w = uw.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = decayed_scores(q, k, log_decay_cum)
    q_decayed = q * log_decay_cum.exp()
    k_to_end = k * (log_decay_cum[..., -1:, :] - log_decay_cum).exp()
    chunk_decay = log_decay_cum[..., -1, :].exp()
    return u, w, attn, q_decayed, k_to_end, chunk_decay, log_decay_cum, k


def scan_chunks(u, w, k_to_end, chunk_decay, state):
    """The sequential part: chunk-start states [N, B, H, K, V], corrected values v_new [N, B, H, C, V] and the
    final state. Without autograd it writes into preallocated chunk-major buffers (each step two fused matmul-adds
    on one chunk's [B*H, ...] block, nothing stacked afterwards); autograd cannot follow out= writes into a shared
    buffer, so with gradients the same recurrence collects fresh tensors and stacks them."""
    num_chunks, batch, heads = u.shape[:3]
    u, w, k_to_end_t = (x.flatten(1, 2) for x in (u, w, k_to_end.transpose(-1, -2)))
    decay = chunk_decay.flatten(1, 2)[..., None]
    state = state.flatten(0, 1)
    if needs_grad(u, w, k_to_end_t, decay, state):
        starts, v_new = [state], []
        for c in range(num_chunks):
            v_new.append(torch.baddbmm(u[c], w[c], starts[c], alpha=-1))
            starts.append(torch.baddbmm(starts[c] * decay[c], k_to_end_t[c], v_new[c]))
        starts, v_new = torch.stack(starts), torch.stack(v_new)
    else:
        starts = state.new_empty(num_chunks + 1, *state.shape)
        starts[0] = state
        v_new = torch.empty_like(u)
        for c in range(num_chunks):
            torch.baddbmm(u[c], w[c], starts[c], alpha=-1, out=v_new[c])
            torch.mul(starts[c], decay[c], out=starts[c + 1])
            starts[c + 1].baddbmm_(k_to_end_t[c], v_new[c])
    by_head = (batch, heads)
    # The final state is cloned so that it does not keep the whole buffer alive.
    return starts[:-1].unflatten(1, by_head), v_new.unflatten(1, by_head), starts[-1].unflatten(0, by_head).clone()


def chunk_outputs(q_decayed, attn, starts, v_new, length: int) -> torch.Tensor:
    """o [B, T, H, V]: each token reads its chunk's start state plus the chunk's earlier tokens."""
    return unchunked(q_decayed @ starts + attn @ v_new, length)


def _run(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale, use_compile: bool):
    # batch rows and heads are independent: on the CPU they go through in cache-sized blocks (cpu_blocks)
    def run_block(q, k, v, g, beta, state):
        return _run_block(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale, use_compile)

    return in_cpu_blocks(run_block, (q, k, v, g, beta), state, max(q.shape[-1], v.shape[-1], chunk_size))


def _run_block(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale, use_compile: bool):
    prepare, output = (intra_chunk, chunk_outputs)
    if use_compile:
        prepare, output = compiled(prepare), compiled(output)
    u, w, attn, q_decayed, k_to_end, chunk_decay, log_decay_cum, k_chunks = prepare(
        q, k, v, g, beta, chunk_size, use_qk_l2norm, scale
    )
    starts, v_new, final = scan_chunks(u, w, k_to_end, chunk_decay, state)
    o = output(q_decayed, attn, starts, v_new, q.shape[1])
    captured = states_at_positions(positions, starts, final, log_decay_cum, k_chunks, v_new, q.shape[1])
    return o, final, captured


def delta_rule_chunked(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale):
    """Chunked kernel on fp32 [B, T, H, *] inputs (heads expanded); same contract as delta_rule_naive."""
    return _run(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale, use_compile=False)


def delta_rule_compiled(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale):
    """delta_rule_chunked with its parallel parts through torch.compile (the chunk loop stays eager: it is two
    matmul-adds per chunk, and unrolling it would recompile for every sequence length)."""
    return _run(q, k, v, g, beta, state, positions, chunk_size, use_qk_l2norm, scale, use_compile=True)
