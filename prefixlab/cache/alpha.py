"""Marconi's retrospective alpha tuning (section 4.2): the bootstrap window of requests, replayed once per alpha of
the grid (once per distinct sequence of evictions, see `AlphaBootstrap.window_flops_saved`).

Marconi runs with alpha 0 until the window closes, 5 x N0 requests after its first eviction (N0: the requests seen by
then), and tunes once. A policy with a `provisional_grid` (dp) also tunes at 2 x N0 on the window so far, on that
coarse grid, so that it runs untuned for less of the trace; the final tuning replaces the provisional alpha. Measured
over the issue-9 sweep (35 points) and 55 held-out points (other seeds and rates): 35 / 35 and 49 / 55 met against
34 / 35 and 49 / 55 without it (benchmarks/RESULTS.md). When every alpha of the provisional grid saved the same FLOPs
on the window (alpha has not yet made a difference to what this workload's evictions save), the final tuning is
skipped and the provisional alpha (the middle of the tie) stays: the final one replays up to 21 x 4 x N0 requests,
15-20x the trace's own replay where it falls inside a short trace, for no measured gain there (RESULTS).

`lag_requests` other than 0 tunes in a background thread: the window and a fresh cache are taken when the tuning
is due, and the alpha it finds takes effect at the first admission after the replays finished (None, PrefixStore's
default: no admission ever waits for them), or exactly `lag_requests` admissions later (an int: waiting for them if
they have not finished by then, so that where alpha changes does not depend on the threads' timing). 0 (the
simulator's) tunes inline, at the admission that makes it due: that request's latency grows by the whole tuning."""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from prefixlab.errors import InvalidInputError, is_finite_number, is_int

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(21))  # Marconi's grid: 0, 0.1, ..., 2.0
PROVISIONAL_MULTIPLIER = 2  # the provisional tuning: 2 x N0 requests after the first eviction's N0


def tune_alpha(replay_flops_saved: Callable[[float], float], grid: Sequence[float] = ALPHA_GRID,
               ties: str = "smallest") -> float:
    """Marconi's retrospective tuning: the alpha whose replay of the bootstrap window saves the most FLOPs
    (`ties`: the smallest of equal ones, as Marconi, or the middle one). `replay_flops_saved(alpha)` replays the
    window into a fresh cache using that alpha."""
    saved = [replay_flops_saved(alpha) for alpha in grid]
    top = max(saved)
    best = [alpha for alpha, flops in zip(grid, saved, strict=True) if flops == top]
    return best[(len(best) - 1) // 2] if ties == "middle" else best[0]


class AlphaBootstrap:
    """Marconi's bootstrap window for tuning alpha once (section 4.2): the requests admitted so far as (input +
    output tokens, input length), at most `history_tokens` tokens of them (the oldest dropped, so the record never
    outgrows the budget of a cache that evicts late or never); due `multiplier` x N0 requests after the first
    eviction, N0 being the requests seen by then."""

    def __init__(self, multiplier: int, history_tokens: int, lag_requests: int | None = 0) -> None:
        self.multiplier, self.history_tokens, self.lag_requests = multiplier, history_tokens, lag_requests
        # (job, the admission it applies at (None: once done), final, its window)
        self.pending: tuple[Future, int | None, bool, AlphaBootstrap] | None = None
        self.requests: deque[tuple[np.ndarray, int]] = deque()
        self.held = self.dropped = 0  # tokens recorded now; requests dropped from the front
        self.tune_at: int | None = None
        self.provisional_done = False
        self.tied = False  # whether every alpha of the last tuning's grid saved the same FLOPs in its replay

    def first_eviction(self, requests: int) -> None:
        if self.tune_at is None:
            self.tune_at = self.multiplier * requests

    def record(self, tokens: np.ndarray, input_length: int) -> None:
        self.requests.append((tokens, input_length))
        self.held += len(tokens)
        while self.held > self.history_tokens and len(self.requests) > 1:
            self.held -= len(self.requests.popleft()[0])
            self.dropped += 1

    def due(self, requests: int) -> bool:
        return self.tune_at is not None and requests >= self.tune_at

    def provisional_due(self, requests: int) -> bool:
        """Whether the provisional tuning (see the module docstring) is due now (and not done yet)."""
        return (not self.provisional_done and self.tune_at is not None
                and requests >= PROVISIONAL_MULTIPLIER * (self.tune_at // self.multiplier))

    def advance(self, requests: int, fresh: Callable, replay: Callable,
                provisional_grid: Sequence[float] | None) -> tuple[float, bool, float, float] | None:
        """After recording a request: start a tuning that is due, or finish one whose time has come. Returns (alpha,
        whether to keep tuning later, seconds the replays took, seconds this call waited for them) when an alpha
        takes effect now. `fresh()`: an empty cache that places states as the live one does now (see `tune`)."""
        if self.pending is not None:
            job, apply_at, final, window = self.pending
            waiting = not job.done() if apply_at is None else requests < apply_at
            if waiting:
                return None
            self.pending = None
            started = time.perf_counter()
            alpha, seconds = job.result()
            return self._tuned(alpha, final, window.tied, seconds, time.perf_counter() - started)
        final = self.due(requests)
        if not final and (provisional_grid is None or not self.provisional_due(requests)):
            return None
        grid = ALPHA_GRID if final else provisional_grid
        if self.lag_requests == 0:
            alpha, seconds = _timed_tune(self, fresh(), replay, grid)
            return self._tuned(alpha, final, self.tied, seconds, seconds)
        window = self.copy()
        apply_at = None if self.lag_requests is None else requests + self.lag_requests
        self.pending = (_executor().submit(_timed_tune, window, fresh(), replay, grid), apply_at, final, window)
        return None

    def _tuned(self, alpha: float, final: bool, tied: bool, seconds: float, waited: float) -> tuple:
        self.provisional_done, self.tied = True, tied
        # final, or a provisional tuning on which alpha made no difference: no further tuning
        return alpha, not (final or tied), seconds, waited

    def tune(self, fresh, replay: Callable, grid: Sequence[float] = ALPHA_GRID) -> float:
        """The alpha of `grid` whose replay of the window (`replay(core, tokens, input_length) -> hit length`) from
        `fresh`, an empty core with alpha 0, saves the most FLOPs."""
        saved = self.window_flops_saved(fresh, replay, grid)
        self.tied = len(set(saved.values())) == 1
        return tune_alpha(saved.__getitem__, grid, ties=fresh.eviction.alpha_ties)

    def window_flops_saved(self, fresh, replay: Callable, grid: Sequence[float] = ALPHA_GRID) -> dict[float, float]:
        """FLOPs each alpha of the grid saves replaying the window from `fresh` (see `tune`). Alpha plays a part only
        in picking victims: the stretch before the first eviction is replayed once for all, and after it one replay
        stands for every alpha that picks its victim at each eviction (FlopAware.alike), so the window is replayed
        once per distinct sequence of evictions, not once per alpha."""
        warm = max(0, self.tune_at // self.multiplier - 1 - self.dropped)
        window = list(self.requests)
        warm_hits = [replay(fresh, tokens, n) for tokens, n in window[:warm]]
        saved: dict[float, float] = {}
        for alpha in grid:
            if alpha in saved:
                continue
            core = fresh.fork()
            core.eviction.alpha = alpha
            core.eviction.alike = alike = {other for other in grid if other not in saved and other != alpha}
            hits = np.array(warm_hits + [replay(core, tokens, n) for tokens, n in window[warm:]], dtype=np.int64)
            saved.update(dict.fromkeys((alpha, *alike), float(np.sum(fresh.spec.flops_saved(hits)))))
        return saved

    def copy(self) -> AlphaBootstrap:
        """An independent record sharing the (immutable) token arrays."""
        twin = copy.copy(self)
        twin.requests = deque(self.requests)
        return twin


def settled_alpha(core) -> float | None:
    """The core's alpha once it will not change any more (tuned, or fixed when the core was built), as a Python
    float (a saved store's JSON header holds it: a numpy alpha, which the core takes, is no JSON number); None while
    it is still to be tuned or for a policy without one."""
    return float(core.alpha) if core.bootstrap is None and core.alpha is not None else None


def settle_alpha(core, alpha: float) -> None:
    """Give an empty core a settled alpha (what a saved store had tuned): it runs with it and tunes no more."""
    core.eviction.alpha, core.bootstrap = alpha, None


def settled_alphas_valid(alphas: object, tiers: Sequence[str]) -> bool:
    """Whether `alphas` is what a saved store records: {tier: a settled alpha (a finite number >= 0) or None}."""
    return isinstance(alphas, dict) and set(alphas) <= set(tiers) and all(
        alpha is None or (is_finite_number(alpha) and alpha >= 0) for alpha in alphas.values())


def check_tuning_lag(lag: object) -> int | None:
    """`tuning_lag_requests` as given to a cache: None or an int >= 0 (numpy ints too), else InvalidInputError."""
    if lag is not None and (not is_int(lag) or lag < 0):
        raise InvalidInputError(f"tuning_lag_requests must be None or an int >= 0, got {lag!r}")
    return None if lag is None else int(lag)


def _timed_tune(window: AlphaBootstrap, fresh, replay: Callable, grid: Sequence[float]) -> tuple[float, float]:
    started = time.perf_counter()
    return window.tune(fresh, replay, grid), time.perf_counter() - started


_EXECUTOR: list[ThreadPoolExecutor] = []
_EXECUTOR_LOCK = threading.Lock()
# a forked child has the executor object but not its thread: it starts its own (else its jobs would never run)
os.register_at_fork(after_in_child=_EXECUTOR.clear)


def _executor() -> ThreadPoolExecutor:
    """One worker thread for every cache's background tunings (they are rare and short)."""
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixlab-alpha"))
        return _EXECUTOR[0]
