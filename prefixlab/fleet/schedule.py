"""Which process serves which prompt, and in what order a process serves its own.

- `assign`: a router (prefixlab.fleet.router) over the prompts in file order, or `partition`: the prompt tree
  cut into contiguous subtrees of balanced new tokens (no router state; every process could compute it). Given a
  `StoreModel`, affinity plans against a model-free copy of each process's store (the simulator's core with the
  model's cost spec, fed the prompts it assigns in the order the process serves them, primes included:
  `ProcessStore`), so it sees evictions and its predicted loads are the work the processes do (`served_work`).
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

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.replay import replay_as_store
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


def prefill(core: PrefixCacheCore, tokens: np.ndarray) -> int:
    """Prefill `tokens` through `core` as a process's PrefixStore does (replay_as_store: it resumes at most all but
    the last token, which yields the logits, keeps the state before that token too, where a repeat resumes, and
    admits them; outputs are not known when planning); returns the tokens computed."""
    return len(tokens) - replay_as_store(core, tokens, len(tokens))


class ProcessStore:
    """One process's store as affinity plans against it: a StoreModel core fed the prompts the process is assigned,
    in the order it serves them. `peek` (the router's question) is what the process will resume of a prompt: with
    `primed` (radix_schedule) a shared prefix at least MIN_PRIME_TOKENS deep, which a prime checkpoints first; else
    the deepest checkpoint in all but its last token. Outputs are not known when planning: only prompts are fed.
    (Where decode steps differ from prefills, model_info.decode_differs_from_prefill, a store resumes at most all
    but the last two tokens: the plan is off by that one token per fully cached prompt.)"""

    __slots__ = ("core", "primed")

    def __init__(self, core: PrefixCacheCore, primed: bool) -> None:
        self.core, self.primed = core, primed

    def _prime_depth(self, tokens: np.ndarray, shared: int) -> int:
        depth = min(shared, len(tokens) - 1)  # a prime leaves the prompt >= 1 token of its own
        return depth if self.primed and depth >= MIN_PRIME_TOKENS else 0

    def peek(self, tokens: np.ndarray) -> tuple[int, int]:
        resumable, shared = self.core.peek(tokens, limit=max(len(tokens) - 1, 0))
        return max(self._prime_depth(tokens, shared), resumable), shared

    def serve(self, tokens: np.ndarray) -> None:
        """Feed one prompt; a shared prefix the store holds without a checkpoint at its end is primed first (the
        store then holds what radix_schedule's prime of that prompt tree node leaves)."""
        resumable, shared = self.core.peek(tokens, limit=max(len(tokens) - 1, 0))
        depth = self._prime_depth(tokens, shared)
        if depth > resumable:
            prefill(self.core, tokens[:depth])
        prefill(self.core, tokens)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def radix_order(prompts: Sequence[np.ndarray]) -> list[int]:
    """Indices of `prompts` in sorted token order: a depth-first walk of their prefix tree."""
    return sorted(range(len(prompts)), key=lambda i: prompts[i].tolist())


def new_tokens(prompts: Sequence[np.ndarray], order: Sequence[int]) -> np.ndarray:
    """Per prompt of `order` (radix order): the tokens it does not share with its predecessor. Their sum is the
    number of distinct prefixes of the prompts (the nodes of their prefix tree): what a fleet of fresh caches
    computes at least, each once on some replica."""
    return np.array([len(prompts[i]) - (common_prefix(prompts[i], prompts[j]) if k else 0)
                     for k, (i, j) in enumerate(zip(order, [*order[:1], *order[:-1]], strict=True))], dtype=np.int64)


def partition(prompts: Sequence[np.ndarray], parts: int) -> list[int]:
    """Part of each prompt: the radix order cut into `parts` contiguous runs of about equal new tokens (tokens a
    prompt does not share with its predecessor in that order, i.e. the prefill work of a warm cache)."""
    if not prompts:
        return []
    order = radix_order(prompts)
    new = new_tokens(prompts, order).astype(np.float64)
    # a prompt goes to the part its midpoint of the cumulative work falls in
    midpoints = np.cumsum(new) - new / 2
    part_of_sorted = np.minimum((midpoints * parts / max(new.sum(), 1.0)).astype(np.int64), parts - 1)
    out = [0] * len(prompts)
    for k, i in enumerate(order):
        out[i] = int(part_of_sorted[k])
    return out


def assign(prompts: Sequence[np.ndarray], processes: int, routing: str, *, seed: int = 0,
           balance_eps: float = 0.15, primed: bool = True, store: StoreModel | None = None) -> list[int]:
    """The process of each prompt (file order) under `routing` (one of ASSIGNMENTS). `primed`: the processes run
    radix_schedule (else they serve their share in file order). Affinity sees the prompts in the order the
    processes serve them (radix order when primed: a subtree's prompts arrive together; file order otherwise), so
    that its predicted loads are the work the processes do (affinity_plan). `store`: affinity asks a
    model of each process's store what it will resume (ProcessStore); without it, it assumes a process keeps all it
    was sent (the fallback, no model cost; `primed`: any held prefix counts as resumable)."""
    if routing not in ASSIGNMENTS:
        raise InvalidInputError(f"--routing {routing!r} is unknown; use one of {', '.join(ASSIGNMENTS)}")
    if store is not None and not isinstance(store, StoreModel):
        raise InvalidInputError(f"store must be a StoreModel or None, got {store!r}")
    if routing == "partition":
        return partition(prompts, processes)
    if routing != "affinity":
        router = make_router(routing, processes, seed)
        return [router.route(tokens).replica for tokens in prompts]
    return affinity_plan(prompts, processes, seed=seed, balance_eps=balance_eps, primed=primed, store=store)[0]


def affinity_plan(prompts: Sequence[np.ndarray], processes: int, *, seed: int = 0, balance_eps: float = 0.15,
                  primed: bool = True, store: StoreModel | None = None) -> tuple[list[int], np.ndarray]:
    """assign(..., "affinity") and the router's predicted prefill tokens per process (with `store`: close to what
    served_work measures while the stores evict nothing; a prime's own tokens are not counted, and a store may keep
    its checkpoint elsewhere, e.g. vllm+ at a block boundary). The router balances against the batch's distinct
    prompt prefixes (a lower bound of the work: families stay together from the first prompt). Where that plan's
    work is over (1 + balance_eps) x the bound (stores that evict, input order), loads grew apart under the bound and
    families were moved once the running mean took over: a plan against the running mean alone is tried too, and
    the one with less work kept. Both keep the balance bound."""
    floor = int(new_tokens(prompts, radix_order(prompts)).sum())
    plan = _affinity_plan(prompts, processes, seed, balance_eps, primed, store, floor)
    if plan[1].sum() <= (1 + balance_eps) * floor:  # the other plan's work is >= floor too: it saves at most eps
        return plan
    other = _affinity_plan(prompts, processes, seed, balance_eps, primed, store, 0)
    return min((plan, other), key=lambda each: (int(each[1].sum()), int(each[1].max())))


def _affinity_plan(prompts: Sequence[np.ndarray], processes: int, seed: int, balance_eps: float, primed: bool,
                   store: StoreModel | None, min_total_prefill_tokens: int) -> tuple[list[int], np.ndarray]:
    models = [ProcessStore(store.core(), primed) for _ in range(processes)] if store is not None else None
    router = make_router("affinity", processes, seed, balance_eps=balance_eps, caches=models,
                         checkpointed=models is not None or not primed,  # ProcessStore.peek knows the primes
                         min_total_prefill_tokens=min_total_prefill_tokens)
    out = [0] * len(prompts)
    for i in radix_order(prompts) if primed else range(len(prompts)):
        out[i] = router.route(prompts[i]).replica
        if models is not None:
            models[out[i]].serve(prompts[i])
    return out, router.loads.copy()


def served_work(prompts: Sequence[np.ndarray], plan: Sequence[int], processes: int, store: StoreModel,
                primed: bool) -> np.ndarray:
    """Tokens each process computes (primes included) serving its share of `plan` as `prefixlab run` does
    (radix_schedule's steps, or file order) through a store `store` models; outputs are not modelled."""
    work = np.zeros(processes, dtype=np.int64)
    for process in range(processes):
        mine = [i for i, p in enumerate(plan) if p == process]
        steps = radix_schedule([prompts[i] for i in mine]) if primed else [(k, 0) for k in range(len(mine))]
        core = store.core()
        for k, length in steps:
            work[process] += prefill(core, prompts[mine[k]][:length] if length else prompts[mine[k]])
    return work


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
