"""A core's policy state across a restart: what `PrefixStore.save` writes besides the entries, and the rebuild that
`PrefixStore.load` does with it, so that a store loaded as it was saved serves on exactly as it would have.

Re-admitting the saved entries (load without this state) keeps what is cached but not how the policy weighs it;
measured model-free (benchmarks/restart_alpha.py), the second half of a trace restarted at its middle lost up to 3.3
points of token hit rate that way. What the policy weighs, all of it saved here:
- the tree's shape: each node's edge as it was, with its id (ties in the eviction indexes go by id) and its
  children in their order (an entry's kind is read through its first child); re-admitted paths merge the edges a
  branch's eviction left apart, and turn their end states into in-edge states that thinning values otherwise;
- each node's last access and the core's clock (recency), its recent resumes (dp's boost of a branch point in use)
  and the efficiency its eviction index holds (dp values in-edge states with the law as it was when they were
  indexed, not as it is now), with the shape it was computed for where the node has another now (a node out of the
  index keeps it, and takes it back if it returns to that shape);
- dp's admission: its overlap laws (histograms, counts, the solutions kept for the current epoch), the entries'
  kinds and the stints under way (the leaf weight), and the eviction's current leaf weight.
Measured (the same benchmark, the load re-admitting, then rebuilt with parts of this state left out): the tree's
shape accounts for 2.3 of the 3.3 points lost at system-prompts 2x the knee, dp's laws and entry kinds together the
rest; recency matters most on lmsys (0.4 at 2x). The parts interact: each alone can cost more than it saves.
The alpha tuner's window is not saved: a core still tuning is saved without this state (it re-admits, and tunes
anew, as before). Counters (`stats()`: requests, evictions) start at zero, as for any new store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefixlab.cache.alpha import settle_alpha
from prefixlab.cache.payload import KVPayload, Payload, SizedKV, SizedState
from prefixlab.cache.tokens import as_tokens, check_namespace
from prefixlab.errors import InvalidInputError, is_finite_number, is_int

if TYPE_CHECKING:
    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.cache.tree import Node, RadixTree

VERSION = 1


@dataclass
class SavedNode:
    """One saved node, its payloads loaded: `parent` is the parent's id (None: the namespace's root)."""

    id: int
    parent: int | None
    namespace: str
    tokens: np.ndarray
    kv: KVPayload | None
    checkpoints: list[tuple[int, Payload]]
    marks: tuple[bool, bool, int]  # branched, truncated, resumed (cache/strict.py)


def preorder(tree: RadixTree) -> Iterator[Node]:
    """Every node but the roots, each after its parent, siblings in their order (the order `rebuild` adds them)."""
    stack = [child for root in reversed(list(tree.roots.values())) for child in reversed(root.children.values())]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children.values()))


def policy_state(core: PrefixCacheCore, nodes: list[Node]) -> dict | None:
    """The core's policy state over `nodes` (its tree in `preorder`), JSON-able; None while alpha is still to be
    tuned (the tuner's window is not saved)."""
    if core.bootstrap is not None:
        return None
    eviction, ids = core.eviction, {node.id for node in nodes}
    shapes = getattr(eviction, "_shapes", {})

    def efficiency(node: Node) -> float | list | None:  # the index's: for the node's shape as it is, or with the
        # shape it was computed for (a node out of the index keeps it, and takes it back if it returns to that shape)
        cached = shapes.get(node.id)
        if cached is None:
            return None
        return cached[1] if cached[0] == _shape(node) else [*cached[0], cached[1]]

    state = {"version": VERSION, "clock": core.clock, "next_id": core.tree._next_id,
             "roots": [[namespace, root.id] for namespace, root in core.tree.roots.items()],
             "nodes": [[node.last_access, node.recent_resumes, node.resumed_at, efficiency(node)] for node in nodes],
             "leaf_weight": getattr(eviction, "leaf_weight", 1.0), "admission": None}
    if hasattr(core.admission, "restore"):
        state["admission"] = core.admission.state(ids)
    return state


def restarted(core: PrefixCacheCore) -> PrefixCacheCore:
    """What a save and a load as saved make of `core`, model-free (size-only payloads): a new core of the same
    options rebuilt from its nodes and policy state, through JSON as a file holds them, with its settled alpha (the
    benchmarks' restart: benchmarks/restart_alpha.py). A core still tuning alpha has no policy state: InvalidInputError
    (a load re-admits it instead)."""
    from prefixlab.cache.core import PrefixCacheCore  # (core.py does not import this module: no cycle, kept local)

    nodes = list(preorder(core.tree))
    state = json.loads(json.dumps(policy_state(core, nodes)))
    if state is None:
        raise InvalidInputError("restarted(core): the core is still tuning alpha, so it has no policy state to keep")
    check_policy_state(state, len(nodes))
    fresh = PrefixCacheCore(core.capacity_bytes, core.policy, core.spec, core.options.block_size,
                            checkpoint_budget=core.options.checkpoint_budget, overflow=core.overflow)
    if core.alpha is not None:
        settle_alpha(fresh, core.alpha)
    rebuild(fresh, sized_nodes(nodes, core.spec), state)
    return fresh


def sized_nodes(nodes: list[Node], spec: ModelSpec) -> list[SavedNode]:
    """`nodes` as saved, with fresh size-only payloads (a model-free restart: benchmarks, tests)."""
    return [SavedNode(node.id, None if node.parent.is_root else node.parent.id, node.namespace, node.tokens.copy(),
                      SizedKV(len(node.tokens), spec.kv_bytes_per_token),
                      [(position, SizedState(spec.state_bytes)) for position in node.ckpt_pos],
                      (node.branched, node.truncated, node.resumed)) for node in nodes]


def check_policy_state(state: object, count: int) -> None:
    """ValueError unless `state` is what `policy_state` writes for a tree of `count` nodes (the admission's part is
    checked when restored: it depends on the policy's law)."""
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"policy state version {state.get('version') if isinstance(state, dict) else state!r}")
    clock, next_id, nodes, weight = state["clock"], state["next_id"], state["nodes"], state["leaf_weight"]
    if not (_count(clock) and _count(next_id) and is_finite_number(weight) and 0 < weight <= 1):
        raise ValueError(f"policy state clock={clock!r}, next_id={next_id!r}, leaf_weight={weight!r}")
    if not isinstance(state["roots"], list) or not all(isinstance(r, list) and len(r) == 2 for r in state["roots"]):
        raise ValueError(f"policy state roots {state['roots']!r}")
    if not isinstance(nodes, list) or len(nodes) != count:
        raise ValueError(f"policy state of {len(nodes) if isinstance(nodes, list) else nodes!r} nodes for {count}")
    for record in nodes:
        last_access, resumes, resumed_at, efficiency = record  # (not a 4-list: ValueError, TypeError)
        if not (_count(last_access) and last_access <= clock and is_finite_number(resumes) and resumes >= 0
                and _count(resumed_at) and resumed_at <= clock
                and (efficiency is None or _efficiency(efficiency) or (
                    isinstance(efficiency, list) and len(efficiency) == 6 and all(map(_count, efficiency[:4]))
                    and isinstance(efficiency[4], bool) and _efficiency(efficiency[5])))):
            raise ValueError(f"policy state of a node {record!r}")
    if not (state["admission"] is None or isinstance(state["admission"], dict)):
        raise ValueError("policy state admission")


def check_admission_state(state: dict, policy: str, spec: ModelSpec, block_size: int, node_ids: set[int]) -> None:
    """ValueError (KeyError, TypeError) unless `state`'s admission part is one that policy `policy` restores (into a
    scratch core: a state is checked whole whether or not it is restored)."""
    from prefixlab.cache.core import PrefixCacheCore  # (core.py does not import this module: no cycle, kept local)

    admission = PrefixCacheCore(1, policy, spec, block_size).admission
    if (state["admission"] is not None) != hasattr(admission, "restore"):
        raise ValueError(f"an admission state for another policy than {policy}")
    if state["admission"] is not None:
        admission.restore(state["admission"], node_ids)


def rebuild(core: PrefixCacheCore, nodes: list[SavedNode], state: dict) -> None:
    """Build `nodes` (saved in `preorder`) in the new, empty `core` as they were, with `state` (`policy_state` of
    the saved core, checked by `check_policy_state`). ValueError (KeyError, TypeError, InvalidInputError) on
    anything inconsistent; the core is then to be discarded."""
    tree, eviction, admission = core.tree, core.eviction, core.admission
    if tree.roots or core.clock or eviction.nodes:
        raise ValueError("rebuild needs a new, empty core")
    ids, root_ids = [node.id for node in nodes], [root_id for _, root_id in state["roots"]]
    if len(set(ids + root_ids)) != len(ids + root_ids) or not all(
            _count(i) and i < state["next_id"] for i in ids + root_ids):
        raise ValueError("node ids repeat or reach the saved next id")
    check_admission_state(state, core.policy, core.spec, core.options.block_size, set(ids))
    # the policies see the tree once it is whole, as saved: built edge by edge, its nodes pass through shapes
    # (a leaf before its children) that would count as stints of the admission's law
    tree.on_change = tree.on_remove = _ignore
    roots = {}
    for namespace, root_id in state["roots"]:
        tree._next_id = root_id
        roots[namespace] = tree.root(check_namespace(namespace))  # (registered by its first node)
    tree._next_id = state["next_id"]
    built: dict[int, Node] = {}
    for saved, (last_access, resumes, resumed_at, _) in zip(nodes, state["nodes"], strict=True):
        namespace = check_namespace(saved.namespace)
        parent = roots[namespace] if saved.parent is None else built[saved.parent]
        tokens = as_tokens(saved.tokens)
        positions = [p for p, _ in saved.checkpoints]
        if (parent.namespace != namespace or not len(tokens) or int(tokens[0]) in parent.children
                or positions != sorted(set(positions))
                or not all(parent.end < p <= parent.end + len(tokens) for p in positions)):
            raise ValueError(f"node {saved.id} does not fit under its parent")
        next_id, tree._next_id = tree._next_id, saved.id
        node = built[saved.id] = tree.add_leaf(parent, tokens, saved.kv, last_access, saved.checkpoints)
        tree._next_id = next_id
        node.branched, node.truncated, node.resumed = saved.marks
        node.recent_resumes, node.resumed_at = float(resumes), resumed_at
    if tree.used_bytes > core.capacity_bytes and not core.overflow:
        raise ValueError(f"the saved nodes hold {tree.used_bytes} bytes, over the budget {core.capacity_bytes}")
    if state["admission"] is not None:
        admission.restore(state["admission"], set(ids))
    core.clock = state["clock"]
    tree.on_change, tree.on_remove = eviction.update, eviction.forget
    if hasattr(eviction, "leaf_weight"):
        eviction.leaf_weight = state["leaf_weight"]
    shapes = getattr(eviction, "_shapes", None)
    for node, (*_, efficiency) in zip(built.values(), state["nodes"], strict=True):
        if shapes is not None and efficiency is not None:  # (update takes the cached efficiency of this shape)
            shapes[node.id] = (tuple(efficiency[:5]), efficiency[5]) if isinstance(efficiency, list) else (
                _shape(node), efficiency)
        eviction.update(node)


def _ignore(node: Node) -> None:
    """A tree's change hook that tells no policy."""


def _shape(node: Node) -> tuple:
    """What FlopAware.update caches a node's efficiency by (inlined there: a hot path)."""
    positions = node.ckpt_pos
    return node.start, len(node.tokens), len(positions), positions[-1] if positions else 0, not node.children


def _efficiency(value: object) -> bool:
    return is_finite_number(value) and value >= 0


def _count(value: object) -> bool:
    """A saved clock, id, time or position: an int from 0 to 2**53 (the clock's ages are computed as floats; a
    larger one fails every request after the load)."""
    return is_int(value) and 0 <= value <= 2**53
