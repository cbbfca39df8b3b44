"""Which process serves which prompt, and in what order a process serves its own.

- `assign`: a router (prefixlab.fleet.router) over the prompts in file order, or `partition`: the prompt tree
  cut into contiguous subtrees of balanced new tokens (no router state; every process could compute it).
- `radix_schedule`: a process's prompts in radix-tree (sorted token) order, each internal node of the prompt tree
  deep enough to matter computed once by a *prime* step (a prefill of the shared prefix alone, so the store holds
  a checkpoint exactly at the branch) before the first prompt of its subtree. Siblings then resume from it while
  it is still cached; in file order a hybrid model's cache only learns a branch point from the second request
  through it, and may have evicted the prefix in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np

from prefixlab.errors import InvalidInputError
from prefixlab.fleet.router import ROUTING_NAMES, make_router

ASSIGNMENTS = (*ROUTING_NAMES, "partition")


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
           balance_eps: float = 0.15, primed: bool = True) -> list[int]:
    """The process of each prompt (file order) under `routing` (one of ASSIGNMENTS); the routers see the
    prompts in file order, except affinity: radix order. `primed`: the processes run radix_schedule, which primes
    every shared prefix, so affinity counts any prefix a process was sent as resumable (not only checkpoints)."""
    if routing not in ASSIGNMENTS:
        raise InvalidInputError(f"--routing {routing!r} is unknown; use one of {', '.join(ASSIGNMENTS)}")
    if routing == "partition":
        return partition(prompts, processes)
    router = make_router(routing, processes, seed, balance_eps=balance_eps, checkpointed=not primed)
    out = [0] * len(prompts)
    # affinity sees the prompts in radix order, so a subtree's prompts arrive together (a batch is known up front)
    for i in radix_order(prompts) if routing == "affinity" else range(len(prompts)):
        out[i] = router.route(prompts[i]).replica
    return out


def radix_schedule(prompts: Sequence[np.ndarray], min_prefix_tokens: int = 32) -> list[tuple[int, int]]:
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
