"""PrefixCacheCore: the radix tree, an admission and an eviction policy and a byte budget.

The one policy code path: the simulator drives it with `Sized*` payloads, PrefixStore with tensors. A request
goes `match` (reusable length, locks what it returns) -> `plan` (positions to capture) -> model -> `admit`
(stores KV and the captured states, evicting to fit) -> `release`. Bad input raises InvalidInputError before
anything changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import numpy as np

from prefixlab.cache.alpha import AlphaBootstrap, check_tuning_lag
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.explain import EvictionLog
from prefixlab.cache.invariants import check_core_invariants
from prefixlab.cache.match import Admission, Match
from prefixlab.cache.payload import KVPayload, Payload, entry_bytes, fitting_prefix
from prefixlab.cache.policies import PolicyOptions, build_policy, check_policy_name, tunes_alpha
from prefixlab.cache.replay import replay_tokens
from prefixlab.cache.strict import extends_sequence, fit_strictly, never_fits
from prefixlab.cache.tokens import as_states, as_tokens, check_namespace
from prefixlab.cache.tree import Node, RadixTree, Walk, path_tokens
from prefixlab.errors import InvalidInputError, check_bool, is_finite_number, is_int


class PrefixCacheCore:
    """Radix-tree prefix cache under a byte budget with a named policy (see prefixlab.cache.policies).

    `alpha=None` (FLOP-aware policies) starts at 0 and tunes Marconi's FLOP-efficiency weight once, as the paper
    does: with N0 the requests seen when the first eviction of an entry happens (dp's thinning moves do not
    count), the first `bootstrap_multiplier` x N0 requests are replayed from an empty cache (whose admission
    starts from what the live one learned: `seed`) for every alpha in 0, 0.1, ..., 2 and the alpha saving the most
    FLOPs is kept (alpha stays 0 if the trace ends first; alpha.py AlphaBootstrap). A number fixes alpha. The
    recorded window is bounded by `history_tokens` (tokens of input + output): past it the oldest requests are
    dropped, so a cache that evicts late replays its most recent `history_tokens` tokens of requests instead.
    `tuning_lag_requests`: None tunes on a background thread, n > 0 too but applies n admissions later, 0 inline.

    An entry that does not fit even after evicting everything unlocked is cut to its longest prefix that fits;
    with `overflow=True` it is kept whole instead and the cache stays over budget until the next admission
    evicts back under it. That is the Marconi simulator's behaviour (a finished request's states are still in
    memory), which the simulator reproduces; a real store keeps the default.

    `explain=True` keeps a bounded `EvictionLog` of what was evicted (`core.evicted`), so that
    cache/explain.py's `why` can tell evicted entries from never-cached ones."""

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "marconi",
        spec: ModelSpec | None = None,
        block_size: int = 32,
        *,
        alpha: float | None = None,
        bootstrap_multiplier: int = 5,
        checkpoint_budget: int = 4,
        overflow: bool = False,
        history_tokens: int = 1 << 22,
        explain: bool = False,
        tuning_lag_requests: int | None = 0,
    ) -> None:
        sizes = {"capacity_bytes": capacity_bytes, "block_size": block_size, "checkpoint_budget": checkpoint_budget,
                 "bootstrap_multiplier": bootstrap_multiplier, "history_tokens": history_tokens}
        for arg, value in sizes.items():  # numpy integers too, stored as ints
            if not is_int(value) or value < 1:
                raise InvalidInputError(f"{arg} must be a positive int, got {value!r}")
        capacity_bytes, block_size, checkpoint_budget, bootstrap_multiplier, history_tokens = map(int, sizes.values())
        check_policy_name(policy)
        overflow = check_bool("overflow", overflow)  # ("no" or None read as truthy / falsy would pick a budget rule)
        if not isinstance(spec, ModelSpec):
            raise InvalidInputError(f"spec must be a ModelSpec (e.g. ModelSpec.from_name('marconi-7b')), got {spec!r}")
        if alpha is not None and (not is_finite_number(alpha) or alpha < 0):  # (NaN: every score NaN, no eviction)
            raise InvalidInputError(f"alpha must be None (tuned) or a finite number >= 0, got {alpha!r}")
        self.capacity_bytes, self.policy, self.spec = capacity_bytes, policy, spec
        self.options = PolicyOptions(block_size=block_size, checkpoint_budget=checkpoint_budget,
                                     capacity_bytes=self.capacity_bytes, strict_budget=not overflow)
        self.hybrid, self.overflow = spec.state_bytes > 0, bool(overflow)
        self.tree = RadixTree()
        self.admission, self.eviction = build_policy(policy, self.tree, spec, self.options, alpha or 0.0)
        self.tree.on_change, self.tree.on_remove = self.eviction.update, self.eviction.forget
        self.clock = self.requests = self.evictions = self.rejected = 0
        self.tuning_seconds = 0.0  # wall time of the alpha tuner's replays (a one-off cost; benchmarks report it)
        self.tuning_wait_seconds = 0.0  # of which admissions waited for (all of it unless tuning_lag_requests)
        self._live: dict[int, Match] = {}
        self._thinned_locked: list[Node] = []  # path nodes the strict budget thinned while a match held them
        # the requests admitted until alpha is tuned (None once tuned, or when alpha is fixed)
        lag = check_tuning_lag(tuning_lag_requests)
        self.bootstrap = (AlphaBootstrap(bootstrap_multiplier, history_tokens, lag)
                          if alpha is None and tunes_alpha(policy) else None)
        self._last_walk: tuple | None = None
        self.evicted = EvictionLog() if explain else None

    @property
    def used_bytes(self) -> int:
        return self.tree.used_bytes

    @property
    def alpha(self) -> float | None:
        return getattr(self.eviction, "alpha", None)

    # the request protocol ----------------------------------------------------------------------------------------

    def match(self, tokens: object, namespace: str = "default") -> Match:
        """The deepest checkpoint at or before the prefix `tokens` share with the cache (every shared token for a
        KV-only model); its entries stay locked until `release`."""
        return self._match(as_tokens(tokens), check_namespace(namespace))

    def _match(self, tokens: np.ndarray, namespace: str, with_kv: bool = True) -> Match:
        """`match` of validated tokens; the replay path leaves `kv` empty (size-only payloads go unused)."""
        self.clock += 1
        self.requests += 1
        walk = self.tree.walk(tokens, namespace)
        node, length, state = self._resumable(walk)
        if length and length == node.end and (node.branched or node.children):  # an inner node's end state resumed
            node.resumed += node.branched  # a branch point in use: strict.py keeps its state
            self.eviction.resumed_from(node, self.clock)
        self._refresh(walk.path[1:] if self.admission.refresh_path else [node])
        self.admission.observe(walk, length)
        self.tree.lock(node, +1)
        on_path = walk.path[1:] if with_kv else []
        kv = [n.kv if n.end <= length else n.kv.split(length - n.start)[0] for n in on_path if n.start < length]
        match = Match(length, walk.shared_length, state, kv, namespace, len(tokens), node, walk)
        self._live[id(match)] = match
        return match

    def peek(self, tokens: object, namespace: str = "default", limit: int | None = None) -> tuple[int, int]:
        """(length, shared_length) that `match` would return now, changing nothing (no lock, no timestamp, no
        observation): what a router asks a replica (prefixlab.fleet.router). `limit`: length as `match` of the
        first `limit` tokens would return it (one walk for both questions)."""
        if limit is not None and (not is_int(limit) or limit < 0):
            raise InvalidInputError(f"limit must be None or an int >= 0, got {limit!r}")
        walk = self.tree.walk(as_tokens(tokens), check_namespace(namespace))
        return self._resumable(walk, limit)[1], walk.shared_length

    def _resumable(self, walk: Walk, limit: int | None = None) -> tuple[Node, int, Payload | None]:
        """The deepest checkpoint on `walk` (every shared token for a KV-only model), at most `limit` deep: (node,
        length, state)."""
        if self.hybrid:
            return self.tree.deepest_checkpoint(walk, limit)
        return walk.path[-1], walk.shared_length if limit is None else min(walk.shared_length, limit), None

    def plan(self, tokens: object, match: Match) -> list[int]:
        """Sorted positions in (match.length, len(tokens)] whose recurrent states the request should capture
        (none for a KV-only model)."""
        tokens = as_tokens(tokens)
        self._check_match(match)
        walk = self._walk_extending(tokens, match)
        return self.admission.plan(walk, len(tokens), match.length, match.input_length) if self.hybrid else []

    def admit(
        self,
        tokens: object,
        kv: Callable[[int, int], KVPayload],
        states: Mapping[int, Payload] | None = None,
        match: Match | None = None,
        namespace: str = "default",
        *,
        restore: bool = False,
    ) -> Admission:
        """Store `tokens` (input + output) with KV from `kv(a, b)` (tokens[a:b]) for the part the cache lacks and
        the captured `states` {position: payload}; evicts unlocked entries to fit. For a hybrid model KV past the
        last kept checkpoint is useless and not stored; a KV-only model stores no states. Returns what was stored
        (falsy if no part of it fits). `restore=True` (a saved or moved entry: load, the offload tier) stores the
        states as they are: nothing is superseded as for a new sequence (vllm+)."""
        tokens, states = as_tokens(tokens), as_states(states)
        if not callable(kv):
            raise InvalidInputError(f"kv must be a callable (start, end) -> KVPayload, got {kv!r}")
        for position, state in states.items():
            is_int = isinstance(position, int | np.integer) and not isinstance(position, bool)
            if not is_int or not 0 < position <= len(tokens):
                raise InvalidInputError(f"states key {position!r} must be an int position in [1, {len(tokens)}]")
            if not isinstance(getattr(state, "nbytes", None), int | np.integer):
                raise InvalidInputError(f"states[{position}] must be a payload with an int nbytes, got {state!r}")
        states = {int(position): state for position, state in states.items()}  # (numpy ints would wrap, not JSON)
        if match is not None:
            self._check_match(match)
            if namespace not in ("default", match.namespace):
                raise InvalidInputError(f"namespace={namespace!r} differs from the match's {match.namespace!r}")
        walk = self._walk_extending(tokens, match) if match else self._walk(tokens, check_namespace(namespace))
        return self._admit(tokens, walk, kv, states, match, restore)

    def _admit(self, tokens: np.ndarray, walk: Walk, kv: Callable[[int, int], KVPayload],
               states: dict[int, Payload], match: Match | None, restore: bool = False) -> Admission:
        """`admit` of validated arguments, `walk` being `tokens`' walk of the current tree (the replay path)."""
        shared = walk.shared_length
        keep_end = (max(states) if states else 0) if self.hybrid else len(tokens)
        new_kv = kv(shared, keep_end) if keep_end > shared else None
        if new_kv is not None and getattr(new_kv, "ntokens", None) != keep_end - shared:
            raise InvalidInputError(f"kv({shared}, {keep_end}) must return a KVPayload of {keep_end - shared} tokens")
        new_states = sorted((p, s) for p, s in states.items()  # a KV-only model's matches never use a state
                            if p > shared or not walk.has_checkpoint(p)) if self.hybrid else []

        if self.bootstrap is not None and self.requests:  # (before any lookup: a load's entries, not traffic)
            self._record(tokens, match)
        self.admission.before_admit(walk)
        self.clock += 1
        top, inside_edge = walk.path[-1], walk.ends_inside_edge  # the path's deepest node is kept while evicting
        thinned, truncated = [], False
        if not self.overflow and never_fits(self, top, new_kv, new_states, shared, keep_end):
            self.rejected += 1  # not even an empty store could hold it: evict nothing for it
            return Admission(0, 0, refused=True)
        fits = self._make_room(entry_bytes(new_kv, new_states), top)
        if not fits and not self.overflow and inside_edge:
            # only `shared` tokens of that node are the path: split it there so its tail may go too (else an entry
            # every prompt enters a little, e.g. past a chat template, fills the cache and refuses all admissions)
            top, inside_edge = self.tree.split(top, shared, self.clock), False
            fits = self._make_room(entry_bytes(new_kv, new_states), top)
        if not fits and not self.overflow and not restore:  # (strict.py)
            fits, new_states, thinned = fit_strictly(self, top, new_kv, new_states, shared, keep_end,
                                                     extends_sequence(top, inside_edge))
        if not fits and not self.overflow:
            # Like a serving engine under pressure, keep the longest prefix of the entry that fits.
            room, whole = self.capacity_bytes - self.used_bytes, keep_end
            new_kv, new_states, keep_end = fitting_prefix(room, self._cut_points(new_states, shared, keep_end), new_kv,
                                                          new_states, shared, keep_end)
            truncated = keep_end < whole
            if new_kv is None and not new_states:
                self.rejected += 1
                self._compact_all([top, *thinned])  # evicting its children may have left it a useless leaf
                return Admission(0, 0, refused=True)
        admitted = Admission(keep_end - shared if new_kv is not None else 0, len(new_states))
        deepest = top
        if new_kv is not None:
            parent = self.tree.split(deepest, shared, self.clock) if inside_edge else deepest
            on_leaf = [(p, s) for p, s in new_states if p > shared]
            new_states = new_states[: len(new_states) - len(on_leaf)]
            deepest = self.tree.add_leaf(parent, tokens[shared:keep_end].copy(), new_kv, self.clock, on_leaf)
            deepest.truncated = truncated
        node, on_node = deepest, []
        for position, state in reversed(new_states):
            while position <= node.start:
                if on_node:
                    self.tree.add_checkpoints(node, on_node)
                node, on_node = node.parent, []
            on_node.append((position, state))
        if on_node:
            self.tree.add_checkpoints(node, on_node)
        if self.admission.refresh_path:
            self._refresh(deepest.ancestors())
        # the tree holds the sequence up to `held` only; states other live matches hold stay
        locked = {id(m.state) for m in self._live.values() if m is not match and m.state is not None}
        held = keep_end if new_kv is not None else shared
        self.admission.after_admit(self.tree, deepest, held, locked, restore)
        if thinned:  # path nodes that lost states while locked: compacted now, or once released
            self._compact_all([top, *thinned])
            self._thinned_locked += [node for node in thinned if node.lock_count]
        else:
            self._compact(top)  # locked while evicting: its children may have gone, and its use with them
        return admitted

    def release(self, match: Match) -> None:
        """Unlock what `match` returned (once)."""
        self._check_match(match)
        self._release(match)

    def _release(self, match: Match) -> None:
        del self._live[id(match)]
        self.tree.lock(match.node, -1)
        self._compact(match.node)
        if self._thinned_locked:
            self._thinned_locked, thinned = [], self._thinned_locked
            self._compact_all(thinned)
            self._thinned_locked = [node for node in thinned if node.lock_count]

    # internals ---------------------------------------------------------------------------------------------------

    def _check_match(self, match: object) -> None:
        if not isinstance(match, Match) or self._live.get(id(match)) is not match:
            raise InvalidInputError("match must be a live Match returned by this core's match() and not yet released")

    def _walk(self, tokens: np.ndarray, namespace: str) -> Walk:
        """tree.walk, reusing the previous walk of the same array while the tree is unchanged (plan -> admit)."""
        key = (id(tokens), namespace, self.tree.version)
        if self._last_walk is None or self._last_walk[0] != key or self._last_walk[1] is not tokens:
            self._last_walk = (key, tokens, self.tree.walk(tokens, namespace))
        return self._last_walk[2]

    def _walk_extending(self, tokens: np.ndarray, match: Match) -> Walk:
        walk = self._walk(tokens, match.namespace)
        if walk.shared_length < match.length:
            raise InvalidInputError(
                f"tokens share only {walk.shared_length} tokens with the cache but the match reused {match.length}; "
                "pass the matched tokens followed by the new ones"
            )
        return walk

    def _refresh(self, nodes: list[Node]) -> None:
        for node in nodes:
            if node.parent is not None and node.last_access != self.clock:
                node.last_access = self.clock
                self.eviction.update(node)

    def _make_room(self, needed: int, keep: Node) -> bool:
        """Evict until `needed` more bytes fit, never touching `keep`'s path; False if they cannot."""
        if self.used_bytes + needed <= self.capacity_bytes:
            return True
        self.tree.lock(keep, +1)
        try:
            while self.used_bytes + needed > self.capacity_bytes:
                victim = self.eviction.pick(self.clock)
                if victim is None:
                    return False
                if self.bootstrap is not None and self.requests and not self.eviction.thins(victim):
                    self.bootstrap.first_eviction(self.requests)  # Marconi's: a whole entry (thinning is not one)
                parent = victim.parent
                if self.evicted is not None:
                    self.evicted.record(victim.namespace, path_tokens(victim), [*victim.ckpt_pos, victim.end])
                self.eviction.free(victim, self.used_bytes + needed - self.capacity_bytes)
                self.evictions += 1
                # a victim that stays (trimmed, thinned) may be useless now; a removed one may leave its parent so
                self._compact(victim if parent.children.get(int(victim.tokens[0])) is victim else parent)
            return True
        finally:
            self.tree.lock(keep, -1)

    def _cut_points(self, new_states: list, shared: int, keep_end: int) -> list[int]:
        """Where an entry may be cut to fit: at a kept state (hybrid) or a block boundary (KV-only)."""
        if self.hybrid:
            return [p for p, _ in new_states]
        block = self.options.block_size
        return [*range((shared // block + 1) * block, keep_end, block), keep_end]

    def _compact(self, node: Node) -> None:
        """Drop what became useless: checkpoint-free leaves of a hybrid model, and checkpoint-free nodes with a
        single child (merged into it so the tree stays a radix tree)."""
        while not node.is_root and node.lock_count == 0 and not node.ckpt_pos:
            if not node.children and self.hybrid:
                parent = node.parent
                self.tree.remove_leaf(node)
                node = parent
                continue
            if len(node.children) == 1:
                self.tree.merge_into_child(node)
            return

    def _compact_all(self, nodes: list[Node]) -> None:
        """`_compact` each of `nodes` still in the tree (compacting one may merge or remove another)."""
        for node in dict.fromkeys(nodes):
            if node.parent is not None and node.parent.children.get(int(node.tokens[0])) is node:
                self._compact(node)

    def _record(self, tokens: np.ndarray, match: Match | None) -> None:
        """Keep the bootstrap window; once it is complete, tune alpha by replaying it (Marconi section 4.2)."""
        self.bootstrap.record(tokens, match.input_length if match else len(tokens))
        tuned = self.bootstrap.advance(self.requests, self._fresh, replay_tokens, self.eviction.provisional_grid)
        if tuned is not None:
            self.eviction.alpha, keep, seconds, waited = tuned
            self.bootstrap = self.bootstrap if keep else None
            self.tuning_seconds += seconds
            self.tuning_wait_seconds += waited

    def _fresh(self) -> PrefixCacheCore:
        """An empty cache with alpha 0 that places states as this one does now (the alpha tuner's replays)."""
        fresh = PrefixCacheCore(self.capacity_bytes, self.policy, self.spec, self.options.block_size, alpha=0.0,
                                checkpoint_budget=self.options.checkpoint_budget, overflow=self.overflow)
        fresh.admission.seed(self.admission)
        return fresh

    def fork(self) -> PrefixCacheCore:
        """An independent copy between requests (no live matches), sharing the immutable payloads (the tuner's)."""
        if self._live:
            raise InvalidInputError(f"fork() copies a cache between requests; {len(self._live)} matches are still "
                                    "live: release them first")
        twin = copy.copy(self)
        twin.tree, nodes = self.tree.copy()
        twin.eviction = self.eviction.copy_for(twin.tree, nodes)
        twin.tree.on_change, twin.tree.on_remove = twin.eviction.update, twin.eviction.forget
        twin.admission = copy.deepcopy(self.admission)
        twin.eviction.link(twin.admission)
        twin._live, twin._last_walk, twin._thinned_locked = {}, None, []
        twin.bootstrap = self.bootstrap.copy() if self.bootstrap is not None else None
        twin.evicted = copy.deepcopy(self.evicted)
        return twin

    # inspection --------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters and byte totals (a snapshot: a plain dict)."""
        return {
            "policy": self.policy, "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
            "kv_bytes": self.tree.kv_bytes, "state_bytes": self.tree.state_bytes,
            "checkpoints": self.tree.num_checkpoints, "nodes": sum(1 for _ in self.tree.nodes()),
            "requests": self.requests, "evictions": self.evictions, "rejected": self.rejected, "alpha": self.alpha,
            "locked_matches": len(self._live), "tuning_seconds": self.tuning_seconds,  # (the alpha tuner's)
            "tuning_wait_seconds": self.tuning_wait_seconds,
            "tuning_pending": bool(self.bootstrap and self.bootstrap.pending),
        }

    def check_invariants(self) -> None:
        """Recompute bytes, locks and the eviction index from scratch; AssertionError on any drift."""
        check_core_invariants(self)
