"""Chunk bookkeeping shared by the chunked kernels: padding, reshaping, and exact states at any position.

Every chunked kernel here computes the state at each chunk start; the state after the first j tokens of a chunk
is then one small masked matmul away (the "split the last chunk" trick), so capture positions need not be aligned:

    S[start + j] = S[start] * exp(G[j-1]) + (left[:j] * exp(G[j-1] - G[:j]))^T @ right[:j]

where G is the within-chunk cumulative log decay and left/right are the kernel's per-token write vectors
(keys and corrected values for the delta rule, dt*x and B for SSD).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_length(length: int, chunk_size: int) -> int:
    return -(-length // chunk_size) * chunk_size


def chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [N, B, H, C, *rest], zero-padded to whole chunks. Chunk-major, so that each chunk's
    slice is one contiguous block for the sequential scan's matmuls."""
    pad = padded_length(x.shape[1], chunk_size) - x.shape[1]
    if pad:
        # F.pad lists (left, right) pairs from the last dim backwards; the time dim is dim 1.
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.unflatten(1, (-1, chunk_size))
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()


def unchunked(x: torch.Tensor, length: int) -> torch.Tensor:
    """[N, B, H, C, D] -> [B, length, H, D] (drops the padding)."""
    return x.permute(1, 0, 3, 2, 4).flatten(1, 2)[:, :length]


# Rows and heads of a chunked kernel are independent; on the CPU they run in blocks whose [rows, T, heads, D] fp32
# inputs hold at most this many bytes. Larger blocks spill the caches, and their temporaries (over 32 MB) are
# mmapped anew by glibc on every call, paying a page fault per 4 KB: a Qwen3.5 delta-rule layer (16 heads) ran 1.28x
# / 1.58x faster at 4K / 16K tokens (benchmarks/RESULTS.md, "Bug hunt and CPU kernel blocks (session 29)").
CPU_BLOCK_BYTES = 8 << 20


def cpu_blocks(device: torch.device, batch: int, length: int, heads: int, dim: int) -> list[list[tuple[slice, slice]]]:
    """Blocks of (rows, heads) covering [batch, heads], one list per block of rows: the whole off the CPU, else at
    most CPU_BLOCK_BYTES of fp32 [rows, length, heads, dim] each (whole divisors, so that a compiled kernel sees one
    shape; one row and one head at the least)."""
    per_head = max(length * dim * 4, 1)
    if device.type != "cpu" or batch * heads * per_head <= CPU_BLOCK_BYTES:
        return [[(slice(None), slice(None))]]
    heads_per = _largest_divisor(heads, CPU_BLOCK_BYTES // (batch * per_head))
    rows_per = batch if heads_per > 1 else _largest_divisor(batch, CPU_BLOCK_BYTES // per_head)
    return [[(slice(r, r + rows_per), slice(h, h + heads_per)) for h in range(0, heads, heads_per)]
            for r in range(0, batch, rows_per)]


def in_cpu_blocks(run_block, tensors: tuple, state: torch.Tensor, dim: int, per_head: tuple = ()) -> tuple:
    """`run_block(*tensors, state, *per_head)` (tensors [B, T, H, ...], state [B, H, ...], per_head [H, ...]) over
    the blocks of cpu_blocks, joined into the whole call's (o, final, {p: state})."""
    batch, length, heads = tensors[0].shape[:3]
    blocks = cpu_blocks(tensors[0].device, batch, length, heads, dim)
    return joined([[run_block(*(t[r, :, h] for t in tensors), state[r, h], *(t[h] for t in per_head))
                    for r, h in row] for row in blocks])


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and (d <= at_most or d == 1))


def joined(parts: list[list[tuple[torch.Tensor, torch.Tensor, dict]]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One (o [B, T, H, V], final [B, H, K, V], {p: state [B, H, K, V]}) from the blocks of cpu_blocks."""
    if len(parts) == 1 and len(parts[0]) == 1:
        return parts[0][0]

    def cat(pick, head_dim: int) -> torch.Tensor:
        return torch.cat([torch.cat([pick(block) for block in row], head_dim) for row in parts], 0)

    return (cat(lambda block: block[0], 2), cat(lambda block: block[1], 1),
            {p: cat(lambda block, p=p: block[2][p], 1) for p in parts[0][0][2]})


# Far below log(float32's smallest subnormal) = -103.3: a token's decay exp(g) is 0 for any g under it, as for
# g = -inf, but cumulative sums of floored values stay finite, so their differences never meet -inf - -inf = NaN.
LOG_DECAY_FLOOR = -110.0


def cumulative_log_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """G, the within-chunk cumulative sums of chunked per-token log decays [..., C, 1 or K], each floored at
    LOG_DECAY_FLOOR (same decays: a decay of 0 stays 0, also where a sum of huge negative values would overflow)."""
    return log_decay.clamp(min=LOG_DECAY_FLOOR).cumsum(dim=-2)


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def causal_mask(chunk_size: int, device: torch.device) -> torch.Tensor:
    """[C, C] bool, True where position i may read position j (j <= i)."""
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()


def decayed_scores(left: torch.Tensor, right: torch.Tensor, log_decay_cum: torch.Tensor) -> torch.Tensor:
    """scores[i, j] = sum_k left_i[k] right_j[k] exp(G_i[k] - G_j[k]) for j <= i, else 0.

    left, right [..., C, K]; log_decay_cum G [..., C, 1] (one decay per head) or [..., C, K] (per key channel,
    which materialises a [..., C, C, K] decay: KDA's chunked path costs K times more memory than GDN's)."""
    chunk_size = left.shape[-2]
    keep = causal_mask(chunk_size, left.device)
    if log_decay_cum.shape[-1] == 1:
        diff = log_decay_cum - log_decay_cum.transpose(-1, -2)
        return (left @ right.transpose(-1, -2)) * diff.masked_fill(~keep, float("-inf")).exp()
    diff = log_decay_cum[..., :, None, :] - log_decay_cum[..., None, :, :]
    decay = diff.masked_fill(~keep[..., None], float("-inf")).exp()
    return torch.einsum("...ik,...jk,...ijk->...ij", left, right, decay)


def state_within_chunk(
    start: torch.Tensor, log_decay_cum: torch.Tensor, left: torch.Tensor, right: torch.Tensor, j: int
) -> torch.Tensor:
    """State after the first j (>= 1) tokens of a chunk that began in `start`.

    start [..., R, S]; log_decay_cum [..., C, 1 or R] (cumulative within the chunk); left [..., C, R];
    right [..., C, S]. The decay scales rows of the state (one per key channel, or one for all).
    """
    last = log_decay_cum[..., j - 1 : j, :]  # [..., 1, 1 or R]
    weights = (last - log_decay_cum[..., :j, :]).exp()
    return start * last.transpose(-1, -2).exp() + (left[..., :j, :] * weights).transpose(-1, -2) @ right[..., :j, :]


def states_at_positions(
    positions: tuple[int, ...],
    chunk_starts: torch.Tensor,
    final_state: torch.Tensor,
    log_decay_cum: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    length: int,
) -> dict[int, torch.Tensor]:
    """{p: state after p tokens} from chunk-start states [N, B, H, R, S] and chunked per-token tensors [N, B, H, C, *].

    Returned states are fresh tensors (never views of the kernel's buffers)."""
    chunk_size = left.shape[-2]
    captured = {}
    for p in positions:
        chunk, offset = divmod(p, chunk_size)
        if p == length:
            captured[p] = final_state.clone()
        elif offset == 0:
            captured[p] = chunk_starts[chunk].clone()
        else:
            per_chunk = (chunk_starts[chunk], log_decay_cum[chunk], left[chunk], right[chunk])
            captured[p] = state_within_chunk(*per_chunk, offset)
    return captured
