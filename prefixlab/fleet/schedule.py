"""Which process serves which prompt, and in what order a process serves its own.

- `assign`: a router (prefixlab.fleet.router) over the prompts in file order, or `partition`: the prompt tree
  cut into contiguous subtrees of balanced new tokens (no router state; every process could compute it). Given a
  `StoreModel`, affinity plans against a model-free copy of each process's store (the simulator's core with the
  model's cost spec, fed the prompts it assigns in the order the process serves them), so it sees evictions.
- `radix_schedule`: a process's prompts in radix-tree (sorted token) order, each internal node of the prompt tree
  deep enough to matter computed once by a *prime* step (a prefill of the shared prefix alone, so the store holds
  a checkpoint exactly at the branch) before the first prompt of its subtree. Siblings then resume from it while
  it is still cached; in file order a hybrid model's cache only learns a branch point from the second request
  through it, and may have evicted the prefix in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from prefixlab.cache.core import PrefixCacheCore, replay_request
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.errors import InvalidInputError
from prefixlab.fleet.router import ROUTING_NAMES, make_router

ASSIGNMENTS = (*ROUTING_NAMES, "partition")
MIN_PRIME_TOKENS = 32  # radix_schedule primes shared prefixes at least this deep


@dataclass(frozen=True)
class StoreModel:
    """What each process's PrefixStore is, for planning: `core()` is a model-free PrefixCacheCore of the same
    policy, capacity and cost spec (ModelSpec.from_config of the model). Checked when built."""

    policy: str
    capacity_bytes: int
    spec: ModelSpec
    block_size: int = 32

    def __post_init__(self) -> None:
        self.core()  # bad values raise InvalidInputError here, before any planning

    def core(self) -> PrefixCacheCore:
        return PrefixCacheCore(self.capacity_bytes, self.policy, self.spec, self.block_size)


def serve_model(core: PrefixCacheCore, prompt: np.ndarray, primed: bool) -> None:
    """Feed `core` one prompt as a process serves it: with `primed` (radix_schedule) a shared prefix the store
    holds without a checkpoint at its end is prefilled alone first, so the prompt resumes there. Outputs are not
    known when planning: only the prompt is admitted."""
    length, shared = core.peek(prompt)
    depth = min(shared, len(prompt) - 1)
    if primed and depth >= MIN_PRIME_TOKENS and depth > length:
        replay_request(core, prompt[:depth], prompt[:0])
    replay_request(core, prompt, prompt[:0])


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def radix_order(prompts: Sequence[np.ndarray]) -> list[int]:
    """Indices of `prompts` in sorted token order: a depth-first walk of their prefix tree."""
    return sorted(range(len(prompts)), key=lambda i: prompts[i].tolist())


def partition(prompts: Sequence[np.ndarray], parts: int) -> list[int]:
    """Part of each prompt: the radix order cut into `parts` contiguous runs of about equal new tokens (tokens a
    prompt does not share with its predecessor in that order, i.e. the prefill work of a warm cache)."""
    if not prompts:
        return []
    order = radix_order(prompts)
    new = np.array([len(prompts[i]) - (common_prefix(prompts[i], prompts[j]) if k else 0)
                    for k, (i, j) in enumerate(zip(order, [order[0], *order[:-1]], strict=True))], dtype=np.float64)
    # a prompt goes to the part its midpoint of the cumulative work falls in
    midpoints = np.cumsum(new) - new / 2
    part_of_sorted = np.minimum((midpoints * parts / max(new.sum(), 1.0)).astype(np.int64), parts - 1)
    out = [0] * len(prompts)
    for k, i in enumerate(order):
        out[i] = int(part_of_sorted[k])
    return out


def assign(prompts: Sequence[np.ndarray], processes: int, routing: str, *, seed: int = 0,
           balance_eps: float = 0.15, primed: bool = True, store: StoreModel | None = None) -> list[int]:
    """The process of each prompt (file order) under `routing` (one of ASSIGNMENTS); the routers see the
    prompts in file order, except affinity: radix order. `primed`: the processes run radix_schedule, which primes
    every shared prefix, so affinity counts any prefix a process holds as resumable (not only checkpoints).
    `store`: affinity asks a model of each process's store what it still holds (else it assumes a process keeps
    all it was sent: the fallback, no model cost)."""
    if routing not in ASSIGNMENTS:
        raise InvalidInputError(f"--routing {routing!r} is unknown; use one of {', '.join(ASSIGNMENTS)}")
    if store is not None and not isinstance(store, StoreModel):
        raise InvalidInputError(f"store must be a StoreModel or None, got {store!r}")
    if routing == "partition":
        return partition(prompts, processes)
    cores = [store.core() for _ in range(processes)] if store is not None and routing == "affinity" else None
    router = make_router(routing, processes, seed, balance_eps=balance_eps, checkpointed=not primed, caches=cores)
    out = [0] * len(prompts)
    # affinity sees the prompts in radix order, so a subtree's prompts arrive together (a batch is known up front);
    # the store models too: the order a process serves its share in when primed (radix_schedule)
    for i in radix_order(prompts) if routing == "affinity" else range(len(prompts)):
        out[i] = router.route(prompts[i]).replica
        if cores is not None:
            serve_model(cores[out[i]], prompts[i], primed)
    return out


def radix_schedule(prompts: Sequence[np.ndarray], min_prefix_tokens: int = MIN_PRIME_TOKENS) -> list[tuple[int, int]]:
    """Steps (prompt index, prime length): prime length 0 serves the prompt; > 0 first prefills
    prompts[index][:length] alone (an internal node of the prompt tree at least `min_prefix_tokens` deep, shallow
    nodes first so deeper ones resume from them)."""
    order = radix_order(prompts)
    lcp = [common_prefix(prompts[a], prompts[b]) for a, b in zip(order, order[1:], strict=False)]
    steps = []
    for k, i in enumerate(order):
        above = lcp[k - 1] if k else 0  # nodes this deep or shallower were entered before this prompt
        depths, smallest = [], None
        # the nodes whose subtree starts here: the running minimum of the following lcps while it stays > above
        for depth in islice(lcp, k, None):
            if depth <= above:
                break
            if smallest is None or depth < smallest:
                smallest = depth
                depths.append(depth)
        for depth in reversed(depths):  # shallow first
            depth = min(depth, len(prompts[i]) - 1)  # a prompt needs >= 1 token of its own to produce logits
            if depth >= min_prefix_tokens and (not steps or steps[-1] != (i, depth)):
                steps.append((i, depth))
        steps.append((i, 0))
    return steps
