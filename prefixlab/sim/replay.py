"""Trace replay through PrefixCacheCore with size-only payloads (the same code path real models use).

Semantics follow the Marconi simulator: requests are replayed in order; a request's input is its full history,
it reuses the deepest cached checkpoint within its input, and after it completes input + output are admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from prefixlab.cache.alpha import check_tuning_lag
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.replay import replay_request
from prefixlab.cache.tokens import as_tokens
from prefixlab.cache.tree import RadixTree
from prefixlab.errors import InvalidInputError, check_bool, is_int
from prefixlab.sim.metrics import SimResult, summarize
from prefixlab.sim.trace import Request


def _check_requests(requests: object) -> Sequence[Request]:
    if not isinstance(requests, Sequence) or not all(isinstance(r, Request) for r in requests):
        raise InvalidInputError("requests must be a list of prefixlab.sim.trace.Request (see prefixlab.sim.formats)")
    return requests


def simulate(
    requests: Sequence[Request],
    policy: str,
    capacity_bytes: int,
    spec: ModelSpec,
    progress: Callable[[int], object] | None = None,
    *,
    block_size: int = 32,
    alpha: float | None = None,
    overflow: bool = True,
    tuning_lag_requests: int = 0,
    as_store: bool = False,
) -> SimResult:
    """Replay `requests` through a `policy` cache of `capacity_bytes`; `progress(1)` is called after each request
    (pass a tqdm's `update`). `alpha=None` tunes Marconi's alpha as the paper does. `overflow=True` keeps an
    entry larger than the free space whole until the next admission, as the Marconi simulator does;
    `overflow=False` never exceeds the budget (see PrefixCacheCore). `tuning_lag_requests` n > 0 applies a tuned
    alpha n requests after it is due, as a PrefixStore tuning in the background does (deterministically).
    `as_store=True` (with overflow=False) replays each request as a PrefixStore serves it (replay_as_store: the
    last prompt token recomputed, the state before it kept, the last output token never fed)."""
    requests, progress = _check_requests(requests), _check_progress(progress)
    core = PrefixCacheCore(capacity_bytes, policy, spec, block_size, alpha=alpha, overflow=overflow,
                           tuning_lag_requests=_check_lag(tuning_lag_requests))
    started = time.perf_counter()
    hits = replay_hits(requests, core, progress, as_store=_check_as_store(as_store, overflow))
    elapsed = time.perf_counter() - started
    lengths = np.array([len(r.input_tokens) for r in requests], dtype=np.int64)
    return summarize(
        policy, capacity_bytes, lengths, hits, spec, alpha=core.alpha, evictions=core.evictions, replay_seconds=elapsed,
        tuning_seconds=core.tuning_seconds,
    )


def replay_hits(requests: Sequence[Request], core: PrefixCacheCore, progress: Callable[[int], object] | None = None,
                *, as_store: bool = False) -> np.ndarray:
    """Each request's hit length, replayed in order through `core` (see simulate)."""
    hits = np.zeros(len(requests), dtype=np.int64)
    for i, request in enumerate(requests):
        hits[i] = replay_request(core, request.input_tokens, request.output_tokens, as_store=as_store)
        if progress is not None:
            progress(1)
    return hits


def _check_progress(progress: object) -> Callable[[int], object] | None:
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be None or a callable taking a count (a tqdm's update), got "
                                f"{progress!r}")
    return progress


def check_fleet_size(replicas: object, num_requests: int, name: str = "replicas") -> int:
    """`replicas` if it is an int in [1, max(num_requests, 1)]: more replicas than requests leave some idle (and
    each is a cache built for nothing), so a fleet replay refuses them, as `simulate --replicas` does."""
    if not is_int(replicas) or replicas < 1:
        raise InvalidInputError(f"{name} must be a positive int, got {replicas!r}")
    if replicas > max(num_requests, 1):
        raise InvalidInputError(f"{name} {replicas} is more than the trace's {num_requests} requests: at most "
                                f"{max(num_requests, 1)} replicas can each serve one")
    return int(replicas)


def _check_as_store(as_store: object, overflow: bool) -> bool:
    check_bool("as_store", as_store)
    if as_store and overflow:  # a store never exceeds its budget
        raise InvalidInputError("as_store=True replays a PrefixStore, whose budget is strict: pass overflow=False")
    return as_store


def simulate_fleet(
    requests: Sequence[Request],
    policy: str,
    capacity_bytes: int,
    spec: ModelSpec,
    replicas: int,
    routing: str,
    progress: Callable[[int], object] | None = None,
    *,
    seed: int = 0,
    balance_eps: float = 0.15,
    block_size: int = 32,
    overflow: bool = True,
    tuning_lag_requests: int = 0,
    as_store: bool = False,
) -> tuple[SimResult, np.ndarray]:
    """Replay `requests` over `replicas` caches of `capacity_bytes` each, a `routing` router (prefixlab.fleet)
    sending each request to one of them (affinity asks the caches what they hold). Returns the fleet's result and
    each replica's prefill tokens (input tokens not reused). `as_store`: as in simulate."""
    from prefixlab.fleet.router import make_router
    from prefixlab.fleet.schedule import ProcessStore

    requests, progress = _check_requests(requests), _check_progress(progress)
    replicas = check_fleet_size(replicas, len(requests))
    lag, as_store = _check_lag(tuning_lag_requests), _check_as_store(as_store, overflow)
    cores = [PrefixCacheCore(capacity_bytes, policy, spec, block_size, overflow=overflow, tuning_lag_requests=lag)
             for _ in range(replicas)]
    # affinity asks the replica caches what they still hold (peek), so it sees their evictions; a store resumes at
    # most all but a prompt's last token, and says so (as `prefixlab run`'s model of a process's store does)
    caches = [ProcessStore(core, primed=False) for core in cores] if as_store else cores
    router = make_router(routing, replicas, seed, balance_eps=balance_eps, caches=caches)
    started = time.perf_counter()
    hits = np.zeros(len(requests), dtype=np.int64)
    for i, request in enumerate(requests):
        # (checked as the caches check them, naming the request; a list input and an empty list output would
        # concatenate to floats)
        input_tokens = as_tokens(request.input_tokens, f"requests[{i}].input_tokens")
        output_tokens = as_tokens(request.output_tokens, f"requests[{i}].output_tokens")
        replica = router.choose(input_tokens).replica
        hits[i] = replay_request(cores[replica], input_tokens, output_tokens, as_store=as_store)
        router.record(replica, np.concatenate([input_tokens, output_tokens]), len(input_tokens) - int(hits[i]))
        if progress is not None:
            progress(1)
    elapsed = time.perf_counter() - started
    lengths = np.array([len(r.input_tokens) for r in requests], dtype=np.int64)
    alphas = {core.alpha for core in cores}  # (one α when every replica tuned the same, as one cache does)
    result = summarize(policy, capacity_bytes, lengths, hits, spec, evictions=sum(c.evictions for c in cores),
                       replay_seconds=elapsed, alpha=alphas.pop() if len(alphas) == 1 else None,
                       tuning_seconds=sum(core.tuning_seconds for core in cores))
    return result, router.loads.copy()


def _check_lag(lag: object) -> int:
    """A replay's tuning lag: an int >= 0 (None, "once found", depends on the threads' timing: not a replay)."""
    if lag is None:
        raise InvalidInputError("tuning_lag_requests must be an int >= 0 in a replay (None depends on timing)")
    return check_tuning_lag(lag)


def load_imbalance(loads: np.ndarray) -> float:
    """max / mean of per-replica work (1.0 = perfectly balanced; 1.0 for an idle fleet)."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(np.max(loads)) / mean if mean > 0 else 1.0


def ceiling(requests: Sequence[Request], spec: ModelSpec) -> SimResult:
    """The infinite-cache bound: each request reuses its longest common prefix with any earlier request's
    input + output (as if every position were checkpointed and nothing evicted)."""
    requests = _check_requests(requests)
    tree = RadixTree()
    hits = np.zeros(len(requests), dtype=np.int64)
    for i, request in enumerate(requests):
        input_tokens = as_tokens(request.input_tokens, f"requests[{i}].input_tokens")  # (as simulate checks them)
        tokens = np.concatenate([input_tokens, as_tokens(request.output_tokens, f"requests[{i}].output_tokens")])
        if spec.reuse_limit is not None:  # nothing past it is held or reused (PrefixStore.admit_limit)
            input_tokens, tokens = input_tokens[: spec.reuse_limit], tokens[: spec.reuse_limit]
        hits[i] = tree.walk(input_tokens, "default").shared_length
        walk = tree.walk(tokens, "default")
        if walk.shared_length < len(tokens):
            parent = tree.split(walk.path[-1], walk.shared_length, 0) if walk.ends_inside_edge else walk.path[-1]
            tree.add_leaf(parent, tokens[walk.shared_length :].copy(), None, 0)
    lengths = np.array([len(r.input_tokens) for r in requests], dtype=np.int64)
    return summarize("ceiling", 0, lengths, hits, spec)
