"""Loading a saved store's entries into its tiers (cache/persist.py reads and checks the file): each tier rebuilt as
it was saved, with its policy state (cache/restore.py), where the store is loaded as it was saved; otherwise each
saved leaf's path re-admitted (files saved before the policy state was kept, another budget or policy, a tier still
tuning its alpha). Either way every payload gets the checks `PrefixStore.admit` makes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefixlab.cache.restore import SavedNode, rebuild
from prefixlab.cache.tensors import TensorKV, check_kv, check_state, kv_from_flat, path_kv, state_from_flat
from prefixlab.errors import CorruptStoreError, InvalidInputError, is_int

if TYPE_CHECKING:
    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.cache.store import PrefixStore


def saved_entries(path: Path, nodes: list[dict], tensors: dict[str, torch.Tensor], tier: str) -> list[tuple]:
    """(tokens, kv(a, b), {position: state}, namespace) per saved leaf, tensors on the host."""
    by_node = _by_node(tensors, tier)
    try:
        by_id, entries = {node["id"]: node for node in nodes}, []
        for leaf in (node for node in nodes if node["leaf"]):
            chain = [leaf]
            while chain[-1]["parent"] is not None and len(chain) <= len(nodes):
                chain.append(by_id[chain[-1]["parent"]])
            if len(chain) > len(nodes):
                raise ValueError(f"node {leaf['id']} has a cycle of parents")
            tokens, pieces, states = [], [], {}
            for node in reversed(chain):
                name, flat = f"{tier}.n{node['id']}", by_node.get(f"n{node['id']}", {})
                tokens += node["tokens"]
                pieces.append(kv_from_flat(flat, name, len(node["tokens"])))
                states.update({p: state_from_flat(flat, f"{name}.s{p}") for p in node["checkpoints"]})
            entries.append((tokens, path_kv(pieces), states, chain[-1]["namespace"], _marks(chain)))
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # InvalidInputError included: shapes disagree
        raise CorruptStoreError(f"the {tier} tier of {path} is inconsistent ({err}); save the store again") from None
    return entries


def admit_entries(store: PrefixStore, entries: dict[str, list[tuple]], rebuilt: dict[str, tuple]) -> int:
    """Admit the saved entries, host tier first (into the offload tier, or the device one when the store has none),
    or rebuild a tier as saved where `rebuilt` holds its (nodes, policy state); returns how many entries neither tier
    holds whole afterwards (refused or evicted: they did not fit)."""
    shapes: dict = {}
    for tier, tier_entries in entries.items():
        core = store.offload if tier == "host" and store.offload is not None else store.core
        device, pin = (store.device, False) if core is store.core else ("cpu", torch.cuda.is_available())
        if tier in rebuilt and _fits(core, rebuilt[tier][0]):
            _rebuild(store, core, *rebuilt[tier], (device, pin, shapes))
            continue
        for tokens, kv, states, namespace, _ in tier_entries:
            for position, state in states.items():
                _check_state(store, shapes, state, position)
            core.admit(tokens, kv=_moved(kv, device, pin, store, shapes),
                       states={p: s.to(device, pin) for p, s in states.items()}, namespace=namespace, restore=True)
        restore_marks(core, tier_entries)
    # (a tier without the namespace is not asked: walking a namespace without a root takes a node id, and a tier
    # rebuilt as saved would then number its next nodes otherwise than the saved one)
    tiers = [core for core in (store.core, store.offload) if core is not None]
    return sum(not any(namespace in core.tree.roots and core.peek(tokens, namespace)[1] == len(tokens)
                       for core in tiers)
               for tier_entries in entries.values() for tokens, _, _, namespace, _ in tier_entries)


def saved_nodes(path: Path, nodes: list[dict], tensors: dict[str, torch.Tensor], tier: str) -> list[SavedNode]:
    """The tier's saved nodes with their payloads (on the host, not yet checked: `admit_entries` checks them)."""
    by_node = _by_node(tensors, tier)
    try:
        found = []
        for node in nodes:
            name, flat = f"{tier}.n{node['id']}", by_node.get(f"n{node['id']}", {})
            found.append(SavedNode(node["id"], node["parent"], node["namespace"], np.asarray(node["tokens"]),
                                   kv_from_flat(flat, name, len(node["tokens"])),
                                   [(p, state_from_flat(flat, f"{name}.s{p}")) for p in node["checkpoints"]],
                                   _node_marks(node)))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptStoreError(f"the {tier} tier of {path} is inconsistent ({err}); save the store again") from None
    return found


def _fits(core: PrefixCacheCore, nodes: list[SavedNode]) -> bool:
    """Whether the saved nodes fit the core's budget as it is loaded: a store saved with overflow=True (not saved
    with the file) can hold more, and is then re-admitted to fit, as under another budget."""
    held = sum(node.kv.nbytes + sum(state.nbytes for _, state in node.checkpoints) for node in nodes)
    return core.overflow or held <= core.capacity_bytes


def _rebuild(store: PrefixStore, core: PrefixCacheCore, nodes: list[SavedNode], state: dict, placed: tuple) -> None:
    """Rebuild the tier in `core` as saved (cache/restore.py), each payload checked and moved as `admit_entries`
    does; `placed`: (device, pin, the shapes seen so far)."""
    device, pin, shapes = placed
    checked = []
    for node in nodes:
        for position, state_payload in node.checkpoints:
            _check_state(store, shapes, state_payload, position)
        kv = _moved(path_kv([node.kv]), device, pin, store, shapes)(0, len(node.tokens))
        checked.append(dataclasses.replace(node, kv=kv, checkpoints=[(p, s.to(device, pin))
                                                                     for p, s in node.checkpoints]))
    rebuild(core, checked, state)


def _by_node(tensors: dict[str, torch.Tensor], tier: str) -> dict[str, dict[str, torch.Tensor]]:
    """The tier's tensors by node ("n<id>")."""
    by_node: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith(f"{tier}."):
            by_node.setdefault(name.split(".")[1], {})[name] = tensor
    return by_node


def _marks(chain: list[dict]) -> dict[int, tuple[bool, bool, int]]:
    """{end position: (branched, truncated, resumed)} of the saved nodes on a leaf's path (files before these marks:
    none), which strict budgets read (cache/strict.py): a branch point requests resumed from, a leaf cut short."""
    marks, end = {}, 0
    for node in reversed(chain):
        end += len(node["tokens"])
        if (saved := _node_marks(node)) != (False, False, 0):
            marks[end] = saved
    return marks


def _node_marks(node: dict) -> tuple[bool, bool, int]:
    """(branched, truncated, resumed) of a saved node (files before these marks: none)."""
    saved = (bool(node.get("branched", False)), bool(node.get("truncated", False)), node.get("resumed", 0))
    if not is_int(saved[2]) or saved[2] < 0:
        raise ValueError(f"node {node['id']} has resumed={saved[2]!r}")
    return saved


def restore_marks(core: PrefixCacheCore, tier_entries: list[tuple]) -> None:
    """Put the saved marks back on the nodes that end where the saved ones ended (an entry refused or cut while
    loading keeps none beyond what it holds)."""
    for tokens, _, _, namespace, marks in tier_entries:
        if marks:
            walk = core.tree.walk(np.asarray(tokens, dtype=np.int64), namespace)
            for node in walk.path[1:]:
                if node.end in marks and node.end <= walk.shared_length:
                    node.branched, node.truncated, node.resumed = marks[node.end]


def _check_state(store: PrefixStore, shapes: dict, state, position: int) -> None:
    """What PrefixStore.admit checks of a state, and one shape per tensor kind."""
    check_state(state, store.layout, f"the state at {position}")
    _same_shapes(shapes, "conv", state.conv)
    _same_shapes(shapes, "recurrent", state.recurrent)


def _moved(kv, device: torch.device | str, pin: bool, store: PrefixStore, shapes: dict):
    def moved(start: int, stop: int) -> TensorKV:
        run = check_kv(kv(start, stop), store.layout, store.dtype)
        _same_shapes(shapes, "keys", run.keys, 1)
        _same_shapes(shapes, "values", run.values, 1)
        _same_shapes(shapes, "indexer", run.indexer, 1)
        return run.to(device, pin)

    return moved


def _same_shapes(shapes: dict, kind: str, tensors: dict, tokens_axis: int | None = None) -> None:
    """InvalidInputError unless each of `tensors` has the shape (less its token axis, where it has one) every tensor
    of the same kind and key loaded before had: a layer's heads and sizes are the model's, not the entry's."""
    for key, tensor in tensors.items():
        shape = tuple(tensor.shape) if tokens_axis is None else (*tensor.shape[:tokens_axis],
                                                                  *tensor.shape[tokens_axis + 1:])
        if shapes.setdefault((kind, key), shape) != shape:
            raise InvalidInputError(f"{kind} of layer {key} have shapes {list(shapes[(kind, key)])} and {list(shape)}")
