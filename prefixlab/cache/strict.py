"""Room for an entry under a strict byte budget (every PrefixStore; the simulator's `--strict-budget`) that does not
fit once everything unlocked is evicted, before it is cut to its longest prefix that fits or refused.

An entry's path stays locked while it is admitted (its KV is the entry's prefix), so a budget that path fills
leaves nothing to evict. What may still go, in this order:
- the path's states, least prefill saved first, other than the deepest one the entry extends and those at branch
  points in use (the end of the upper edge of a split, where requests diverged, once two requests resumed from it:
  after a document many questions share; a conversation whose history is re-rendered branches at each turn, where
  its next turn alone resumes);
- for a sequence's next stage (an entry extending a leaf that ends where an earlier request's sequence did, not cut
  short, and that no request branched off: a conversation's next turn, an agent's next step), its own states
  inside it (its end is what the next stage resumes from), and last of all the state it extends, which its end
  supersedes.
States a live match resumes from never go. An entry whose cheapest cut cannot fit beside its path's KV even in an
empty store is refused before anything is evicted for it.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.payload import KVPayload, Payload, entry_bytes
from prefixlab.cache.tree import Node, path_tokens


def cheapest_cut_bytes(new_kv: KVPayload | None, new_states: list[tuple[int, Payload]], shared: int,
                       first_end: int | None) -> int:
    """Bytes of the entry cut at `first_end` (its first cut point; None: nothing to store)."""
    if first_end is None:
        return 0
    kv_bytes = new_kv.nbytes * (first_end - shared) // new_kv.ntokens if new_kv and first_end > shared else 0
    return kv_bytes + sum(s.nbytes for p, s in new_states if p <= first_end)


def path_kv_bytes(top: Node, shared: int) -> int:
    """KV bytes of the first `shared` tokens of `top`'s path (what an admission below them can never evict)."""
    inside = top.kv_bytes * (shared - top.start) // len(top.tokens) if top.kv is not None and top.tokens.size else 0
    return inside + sum(node.kv_bytes for node in top.ancestors()[1:])


def never_fits(core, top: Node, new_kv: KVPayload | None, new_states: list[tuple[int, Payload]], shared: int,
               keep_end: int) -> bool:
    """Whether an entry below `top` that does not fit `core` now could not fit even an empty one: its cheapest cut
    and its path's KV are over the budget (looked at only when it does not fit: the path is walked)."""
    if core.used_bytes + entry_bytes(new_kv, new_states) <= core.capacity_bytes:
        return False
    ends = core._cut_points(new_states, shared, keep_end)
    return bool(ends) and path_kv_bytes(top, shared) + cheapest_cut_bytes(
        new_kv, new_states, shared, ends[0]) > core.capacity_bytes


def thin_states(states: list[tuple[object, int, Payload]], keep: set[tuple[int, int]], want_bytes: int,
                spec: ModelSpec, drop: Callable[[object, int, Payload], int]) -> int:
    """Drop `states` (root-first (key, position, state) triples) with `drop` until `want_bytes` are freed, those
    saving the least prefill over the state kept before them first, never one in `keep` ((id(state), position)
    pairs). Returns the bytes freed."""
    states, freed = list(states), 0
    while freed < want_bytes:
        below, cheapest = 0, None
        for i, (_, position, state) in enumerate(states):
            if (id(state), position) not in keep:
                saved = spec.prefill_flops(position - below, below) / max(state.nbytes, 1)
                if cheapest is None or saved < cheapest[0]:
                    cheapest = (saved, i)
            below = position
        if cheapest is None:
            break
        freed += drop(*states.pop(cheapest[1]))
    return freed


def extends_sequence(top: Node, inside_edge: bool) -> bool:
    """Whether an entry whose walk ended at `top` is a sequence's next stage (extends a leaf that ends where an
    earlier request's sequence did, not cut short, and that no request branched off) rather than a branch off a
    shared path."""
    return not inside_edge and not top.children and not top.is_root and not top.branched and not top.truncated


def fit_strictly(core, top: Node, new_kv: KVPayload | None, new_states: list[tuple[int, Payload]], shared: int,
                 keep_end: int, sequence: bool) -> tuple[bool, list[tuple[int, Payload]], list[Node]]:
    """Make room on `core` (a PrefixCacheCore, everything unlocked evicted) for an entry below `top` by the moves
    above, if they can make room for at least its cheapest form. Returns (whether the entry, with the states
    returned, fits now; those states; the path nodes that lost states)."""
    on_path = [(n, p, s) for n in top.ancestors()[-2::-1] for p, s in zip(n.ckpt_pos, n.ckpt_state, strict=True)]
    protected = {(id(m.state), m.length) for m in core._live.values() if m.state is not None}
    protected |= {(id(s), p) for n, p, s in on_path if n.resumed > 1 and p == n.end}  # a branch point in use
    extended = [(n, p, s) for n, p, s in on_path if p <= shared][-1:]  # the state the entry extends
    keep = protected | {(id(s), p) for _, p, s in extended}
    last_resort = [t for t in extended if sequence and (id(t[2]), t[1]) not in protected]
    thinnable = sum(s.nbytes for n, p, s in on_path if (id(s), p) not in keep) + sum(s.nbytes for *_, s in last_resort)
    ends = core._cut_points(new_states, shared, keep_end)
    smallest = cheapest_cut_bytes(new_kv, new_states, shared, ends[0] if ends else None)
    if core.used_bytes - thinnable + smallest > core.capacity_bytes:
        return False, new_states, []  # nothing here makes room for even its cheapest cut: it is refused as it is
    thinned: list[Node] = []

    def drop(node: Node, position: int, state: Payload) -> int:
        thinned.append(node)
        core.evictions += 1
        if core.evicted is not None:
            core.evicted.record(node.namespace, path_tokens(node), [position])
        return core.eviction.drop_state(node, node.ckpt_pos.index(position))

    def excess(states: list[tuple[int, Payload]]) -> int:
        return core.used_bytes + entry_bytes(new_kv, states) - core.capacity_bytes

    thin_states(on_path, keep, excess(new_states), core.spec, drop)
    if excess(new_states) <= 0 or not sequence or not new_states:  # (a KV-only model's entry: no states)
        return excess(new_states) <= 0, new_states, thinned
    left_out: set[int] = set()

    def leave_out(index: int, position: int, state: Payload) -> int:
        left_out.add(index)
        return state.nbytes

    for last in (False, True):  # its own inner states, then (last of all) the state it extends
        if last:
            if not last_resort:
                break
            thin_states(last_resort, set(), excess(new_states[-1:]), core.spec, drop)
        left_out.clear()
        end = (id(new_states[-1][1]), new_states[-1][0])
        thin_states([(i, p, s) for i, (p, s) in enumerate(new_states)], {end}, excess(new_states), core.spec,
                    leave_out)
        states = [state for i, state in enumerate(new_states) if i not in left_out]
        if excess(states) <= 0:
            return True, states, thinned
    return False, new_states, thinned
