"""CUDA backends: fla's chunk_gated_delta_rule and mamba_ssm's mamba_chunk_scan_combined, imported lazily.

Captured states come out of the package's own prefill pass, whose outputs stay those of a call capturing nothing:
- fla: its chunk kernel computes the state at every 64-token chunk start (its `h`, which its public function does
  not return); `fla_chunk_states` taps the one internal function that makes it, and a state inside a chunk is
  rolled forward from its chunk's start by fla's fused recurrent kernel (one launch for every capture).
- mamba_ssm (one sequence): its public `return_varlen_states` reads states at sequence ends from the pass's chunk
  states; the positions it cannot serve exactly are rolled forward by prefixlab's kernel over at most a chunk.
Where neither applies (another fla version or backend; a batch for mamba_ssm) the sequence is split at the capture
positions and each segment resumes from the previous segment's final state: exact by construction, one call per
segment.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence

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


FLA_CHUNK = 64  # fla's gated delta rule chunk length (its default)
_tap = threading.local()  # .sink: the list a tapped call appends fla's chunk states to (None: not tapping)
_tap_lock = threading.Lock()


def tap_fla_chunk_states() -> bool:
    """Wrap `chunk_gated_delta_rule_fwd_h` (fla 0.6's maker of the chunk-start states, a global of
    fla.ops.gated_delta_rule.chunk that its public chunk function calls) so that `fla_chunk_states` can see its h.
    False where this fla has no such function."""
    try:
        import fla.ops.gated_delta_rule.chunk as chunk_module
    except ImportError:
        return False
    with _tap_lock:
        inner = getattr(chunk_module, "chunk_gated_delta_rule_fwd_h", None)
        if inner is None or getattr(inner, "prefixlab_tap", False):
            return inner is not None

        def tapped(*args, **kwargs):
            result = inner(*args, **kwargs)
            sink = getattr(_tap, "sink", None)
            if sink is not None:
                sink.append(result[0])
            return result

        tapped.prefixlab_tap = True
        chunk_module.chunk_gated_delta_rule_fwd_h = tapped
        return True


def fla_chunk_states(
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """run() (one tapped chunk_gated_delta_rule call) -> (outputs, final state, h [B, ceil(T / 64), H, K, V], the
    state at each chunk's start as fla computed it; None when the call made none, e.g. another fla backend)."""
    _tap.sink = sink = []
    try:
        out, final = run()
    finally:
        _tap.sink = None
    return out, final, sink[0] if len(sink) == 1 else None


_fla_h_trusted: bool | None = None  # fla's h checked against fla's own final state, once per process


def fla_h_trusted(h: torch.Tensor, k, v, g, beta, final: torch.Tensor, recurrent: Callable) -> bool:
    """Once per process: the last chunk rolled forward from h must land on fla's own final state, i.e. h means what
    fla 0.6's does (the state at each chunk's start, in the final state's layout). Else: warn, and let the caller
    capture by segments from then on."""
    global _fla_h_trusted
    if _fla_h_trusted is None:
        tail = slice((h.shape[1] - 1) * FLA_CHUNK, None)
        _, rolled = recurrent(k[:, tail], k[:, tail], v[:, tail], g=g[:, tail], beta=beta[:, tail],
                              initial_state=h[:, -1].to(torch.float32), output_final_state=True)  # fmt: skip
        _fla_h_trusted = chunk_states_agree(rolled, final, "fla")
    return _fla_h_trusted


def chunk_states_agree(got: torch.Tensor, final: torch.Tensor, package: str) -> bool:
    """A state derived from `package`'s chunk states (kept in the inputs' dtype, so within 5 % of the largest value)
    against the same call's final state; warns when they do not agree."""
    error = (got.float() - final.float()).abs().max().item()
    agree = error <= 0.05 * final.float().abs().max().item() + 1e-3
    if not agree:
        warnings.warn(f"prefixlab: {package}'s chunk states do not lead to its final state (off by {error:.3g}); "
                      "states are captured by segments instead", stacklevel=3)  # fmt: skip
    return agree


def roll_forward(
    h: torch.Tensor, k, v, g, beta, positions: Sequence[int], chunk: int, recurrent: Callable
) -> States:
    """{p: state after p tokens} from the chunk-start states h [B, N, H, K, V]: p's chunk start, then its tokens
    up to p through `recurrent(q, k, v, g=, beta=, initial_state=, output_final_state=)` (fla's fused recurrent
    kernel), every position in one call. Rows are left-padded to one width with tokens of g = beta = 0, which
    leave a delta-rule state as it is."""
    captured = {p: h[:, p // chunk].to(torch.float32, copy=True) for p in positions if p % chunk == 0}
    inside = [p for p in positions if p % chunk]
    if not inside:
        return captured
    width = max(p % chunk for p in inside)
    tokens = torch.tensor([[p - width + j for j in range(width)] for p in inside])  # [len(inside), width]
    starts = torch.tensor([p - p % chunk for p in inside])[:, None]
    index, live = tokens.maximum(starts), tokens >= starts
    index, live = index.to(k.device, non_blocking=True), live.to(k.device, non_blocking=True)

    def rows(x: torch.Tensor, padded_with_zeros: bool = False) -> torch.Tensor:
        picked = x[:, index]  # [B, len(inside), width, H, ...]
        if padded_with_zeros:
            picked = torch.where(live.view(1, *live.shape, *(1,) * (x.dim() - 2)), picked, 0)
        return picked.transpose(0, 1).flatten(0, 1)  # [len(inside) * B, width, H, ...], position-major

    chunk_ids = (starts[:, 0] // chunk).to(h.device, non_blocking=True)
    initial = h[:, chunk_ids].transpose(0, 1).flatten(0, 1).to(torch.float32)
    keys = rows(k)
    _, final = recurrent(keys, keys, rows(v), g=rows(g, True), beta=rows(beta, True), initial_state=initial,
                         output_final_state=True)  # fmt: skip
    captured.update(zip(inside, final.unflatten(0, (len(inside), k.shape[0])), strict=True))
    return captured


def delta_rule_fla(
    q, k, v, g, beta, state, positions, use_qk_l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """[B, T, H, *] fp16 / bf16 inputs (heads expanded), fp32 state -> fla's chunked kernel (chunks of 64), the
    states at `positions` from the same pass; a one-token call (a decode step) -> fla's fused recurrent kernel, one
    launch, as transformers decodes with."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    length = q.shape[1]

    def segment(start: int, stop: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        piece = slice(start, stop)
        kernel = fused_recurrent_gated_delta_rule if stop - start == 1 else chunk_gated_delta_rule
        return kernel(
            # by keyword: the fused recurrent kernel's fifth parameter is gk (per-channel decay), not beta
            q[:, piece], k[:, piece], v[:, piece], g=g[:, piece], beta=beta[:, piece],
            scale=scale, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        )  # fmt: skip

    inside = [p for p in positions if 0 < p < length]
    if length > 1 and inside and tap_fla_chunk_states():
        o, final, h = fla_chunk_states(lambda: segment(0, length, state))
        recurrent = functools.partial(fused_recurrent_gated_delta_rule, scale=scale,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm)  # fmt: skip
        # else (h in another layout, or made by another backend): the segment driver, a second pass
        if h is not None and h.shape == (q.shape[0], -(-length // FLA_CHUNK), *state.shape[1:]) and fla_h_trusted(
            h, k, v, g, beta, final, recurrent
        ):
            captured = roll_forward(h, k, v, g, beta, inside, FLA_CHUNK, recurrent)
            if 0 in positions:
                captured[0] = state.clone()
            if length in positions:
                captured[length] = final.clone()
            return o, final, captured
    return run_in_segments(length, positions, state, segment)


def varlen_served(positions: Sequence[int], chunk: int) -> list[int]:
    """The positions mamba_ssm's `return_varlen_states` can give exactly when they are the ends of consecutive
    sequences [0, p1), [p1, p2), ... over one continuous scan: its kernel adds a chunk's start state only when the
    sequence began before that chunk, so each served p needs the previous served one (or 0) before p's chunk."""
    served, last = [], 0
    for p in positions:
        if last < (p - 1) // chunk * chunk:
            served.append(p)
            last = p
    return served


_mamba_varlen_trusted: bool | None = None  # mamba_ssm's varlen states checked against its final state, once


def ssd_mamba_ssm(
    x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state, positions, chunk_size
) -> tuple[torch.Tensor, torch.Tensor, States]:
    """ssd's contract on mamba_ssm's Triton kernels (raw inputs: mamba_ssm applies dt_bias, softplus, limit, D).
    One sequence (batch 1): one call, the states read from its chunk states through `return_varlen_states` (mamba_ssm's
    public varlen-state output, the outputs unchanged), a position it cannot serve (a second one in the same chunk,
    or one in the first chunk) rolled forward from the nearest earlier state by prefixlab's torch kernel over at most
    a chunk. Batches: the segment driver."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    global _mamba_varlen_trusted
    batch, length, heads, head_dim = x.shape
    if initial_state is None:
        initial_state = x.new_zeros(batch, heads, head_dim, B.shape[-1], dtype=torch.float32)
    if length == 1 and tuple(dt_limit) == (0.0, math.inf):  # a decode step: one launch, as transformers decodes
        return _ssd_step_mamba_ssm(x, dt, A, B, C, D, dt_bias, dt_softplus, initial_state, positions)
    call = functools.partial(mamba_chunk_scan_combined, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                             dt_limit=tuple(dt_limit), return_final_states=True)  # fmt: skip

    def segment(start: int, stop: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        piece = slice(start, stop)
        return call(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], chunk_size, initial_states=initial)

    inside = [p for p in positions if 0 < p < length]
    if batch == 1 and inside and _mamba_varlen_trusted is not False:
        served, initial = varlen_served(inside, chunk_size), initial_state.to(torch.float32)
        # once per process: one more end, at the last token, whose varlen state must be the call's final state
        checking = _mamba_varlen_trusted is None and varlen_served([*served, length], chunk_size)[-1:] == [length]
        ends = [0, *served, length] if checking else [0, *served]
        if len(ends) > 1:
            y, final, varlen = call(x, dt, A, B, C, chunk_size, initial_states=initial, return_varlen_states=True,
                                    cu_seqlens=torch.tensor(ends, dtype=torch.int32).to(x.device, non_blocking=True))
        else:
            (y, final), varlen = call(x, dt, A, B, C, chunk_size, initial_states=initial), None
        if checking:
            _mamba_varlen_trusted = chunk_states_agree(varlen[-1:], final, "mamba_ssm")
        if _mamba_varlen_trusted is not False:
            # (copies: `initial` may be the caller's fp32 tensor, the cache's buffer a later step overwrites)
            known = {0: initial.clone()} | {p: varlen[i : i + 1].to(torch.float32) for i, p in enumerate(served)}
            captured = {p: known[p] for p in positions if p in known}
            for p in inside:
                if p not in known:
                    known[p] = captured[p] = _roll_ssd(known, p, x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
            if length in positions:
                captured[length] = final.to(torch.float32, copy=True)
            return y.to(x.dtype), final.to(torch.float32), captured
    y, final, captured = run_in_segments(length, positions, initial_state.to(torch.float32), segment)
    return y.to(x.dtype), final.to(torch.float32), {p: s.to(torch.float32) for p, s in captured.items()}


def _ssd_step_mamba_ssm(x, dt, A, B, C, D, dt_bias, dt_softplus, initial_state, positions):
    """One token through mamba_ssm's selective_state_update (it takes no dt limit), per-head parameters expanded
    over the head dimension as transformers passes them (the kernel ties them back)."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    heads, head_dim, state_size = initial_state.shape[1:]
    state = initial_state.to(torch.float32, copy=True)  # updated in place by the kernel
    per_head = lambda t: t if t is None or t.dim() == 2 else t[:, None].expand(heads, head_dim)  # noqa: E731
    y = selective_state_update(
        state, x[:, 0], dt[:, 0, :, None].expand(-1, heads, head_dim), A[:, None, None].expand(heads, head_dim,
        state_size), B[:, 0], C[:, 0], D=per_head(D), dt_bias=per_head(dt_bias), dt_softplus=dt_softplus,
    )  # fmt: skip
    captured = {p: initial_state.to(torch.float32, copy=True) if p == 0 else state.clone() for p in positions}
    return y[:, None].to(x.dtype), state, captured


def _roll_ssd(known: States, p: int, x, dt, A, B, C, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    """The state after p tokens from the nearest earlier known state, by prefixlab's chunked torch kernel."""
    from prefixlab.recurrent.ssd import ssd

    q = max(k for k in known if k < p)
    piece = slice(q, p)
    _, state, _ = ssd(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], None, dt_bias, dt_softplus, dt_limit,
                      known[q], backend="torch")  # fmt: skip
    return state
