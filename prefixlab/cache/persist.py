"""Saving and loading a PrefixStore (`store.save(path)`, `PrefixStore.load(path, model)`): one safetensors file.

What a file holds
  tensors   "<tier>.n<node id>.k.<layer>" / ".v.<layer>" (the KV of a node's edge) and
            "<tier>.n<node id>.s<position>.conv|recurrent.<layer>.<i>" (its checkpoints), tier "device" or "host"
            (the offload tier). A prefix shared by many entries is written once.
  metadata  "prefixlab": the JSON header: format, model identity (config + dtype, cache/model_info.py), the weights
            fingerprint, the store's options, each tier's settled alpha (kept when loaded with the same options) and
            nodes (id, parent, namespace, tokens, checkpoints, marks), and each tensor's dtype, shape and BLAKE2b
            digest of its bytes as written;
            "prefixlab.blake2b": the digest of the header text.

Integrity. `load` verifies, before it builds anything: the header digest, the identity, the weights fingerprint and
every tensor's digest, dtype and shape. A damaged file raises CorruptStoreError naming the file (and the tensor), a
file for another model or other weights ModelMismatchError; never a raw safetensors or JSON error, and the model is
left without hooks or patches. Digests catch corruption; they are not signatures (a crafted file can hold any KV).

Weights fingerprint: one BLAKE2b digest per parameter and buffer (name, dtype, shape and bytes), so a fine-tune with
the same config is told apart and the message names the tensors that differ. Cost: every weight copied to the host
and hashed once, on up to 8 threads (0.38 GB/s measured on one loaded AMD EPYC core): seconds to tens of seconds for
a 14 GB model, so a store computes it at its first save and keeps it; every `load` computes it for its model.
Weights on the meta device (accelerate disk offload) count by name, dtype and shape only. Per-tensor checksums cost
the same per byte of cached entries, at save and at load.

Atomic writes. `save` writes a temporary file beside the target, fsyncs it and renames it over the target, so a
failure or crash mid-write leaves the previous file intact (a killed process: its `.NAME.*.tmp`, to delete).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from prefixlab.cache.alpha import settle_alpha, settled_alpha, settled_alphas_valid
from prefixlab.cache.defaults import check_model_argument
from prefixlab.cache.digests import digest, tensor_digests
from prefixlab.cache.model_info import model_identity
from prefixlab.cache.policies import POLICY_NAMES
from prefixlab.cache.tensors import (
    TensorKV,
    check_kv,
    check_state,
    kv_from_flat,
    kv_to_flat,
    path_kv,
    state_from_flat,
    state_to_flat,
)
from prefixlab.errors import CorruptStoreError, InvalidInputError, ModelMismatchError, PrefixlabError, is_int

if TYPE_CHECKING:
    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.cache.store import PrefixStore

FORMAT = 2
HEADER_KEY, HEADER_DIGEST_KEY = "prefixlab", "prefixlab.blake2b"
TIERS = ("host", "device")  # load order: device entries are admitted last, so they win a tight device budget
# store -> (the weights version it was computed at, the weights fingerprint of its model)
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """{name: digest of name, dtype, shape and bytes} for every parameter and buffer of `model`, in name order."""
    return tensor_digests(dict(model.named_buffers()) | dict(model.named_parameters()), labelled=True)


def store_fingerprint(store: PrefixStore) -> dict[str, str]:
    """The weights fingerprint of the store's model, computed once per store and weights version."""
    version, fingerprint = _fingerprints.get(store, (None, None))
    if fingerprint is None or version != store.weights:
        fingerprint = weights_fingerprint(store.model)
        _fingerprints[store] = store.weights, fingerprint
    return fingerprint


# -- save ---------------------------------------------------------------------------------------------------------
def save_store(store: PrefixStore, path: str | Path) -> None:
    """Write every entry of both tiers of `store` to `path` atomically (see the module docstring)."""
    path = _path(path)
    if not path.parent.is_dir() or path.is_dir():
        raise InvalidInputError(f"path={str(path)!r} must be a file path in an existing directory")
    store.check_weights(serving=False)  # entries of weights changed since are dropped, not saved as the new ones'
    store.flush()
    tensors: dict[str, torch.Tensor] = {}
    tiers = {tier: _tier_to_flat(core, tier, tensors)
             for tier, core in (("device", store.core), ("host", store.offload)) if core is not None}
    header = {
        "format": FORMAT, "identity": store.identity, "weights": store_fingerprint(store),
        "capacity_bytes": store.capacity_bytes,
        "offload_capacity_bytes": store.offload.capacity_bytes if store.offload is not None else None,
        "policy": store.core.policy, "block_size": store.core.options.block_size, "tiers": tiers,
        "alpha": {tier: settled_alpha(core) for tier, core in (("device", store.core), ("host", store.offload))
                  if core is not None},
        "tensors": {name: [str(tensors[name].dtype), list(tensors[name].shape), hexdigest]
                    for name, hexdigest in tensor_digests(tensors).items()},
    }
    text = json.dumps(header)
    try:
        _write_atomically(path, tensors, {HEADER_KEY: text, HEADER_DIGEST_KEY: digest(text.encode())})
    except SafetensorError as err:  # (safetensors caps a file's header, which lists every tensor, at 100 MB)
        if "I/O error" in str(err):  # (its wording for a failed write: a full disk, a folder taking no new file)
            raise OSError(f"PrefixStore.save: cannot write {str(path)!r} ({err}); make room on its disk or save to "
                          f"another folder. {path} was left as it was") from None
        raise InvalidInputError(
            f"PrefixStore.save: {len(tensors)} tensors of {sum(len(n) for n in tiers.values())} entries do not fit "
            f"one safetensors file ({err}); save a smaller store (a lower capacity, or clear() part of the work). "
            f"{path} was left as it was") from None


def _tier_to_flat(core: PrefixCacheCore, tier: str, tensors: dict[str, torch.Tensor]) -> list[dict]:
    """Add the tier's tensors (contiguous, on the host) to `tensors`; return its nodes for the header."""
    nodes = []
    for node in core.tree.nodes():
        if node.is_root:
            continue
        name = f"{tier}.n{node.id}"
        flat = kv_to_flat(node.kv, name) if node.kv is not None else {}
        for position, state in zip(node.ckpt_pos, node.ckpt_state, strict=True):
            flat.update(state_to_flat(state, f"{name}.s{position}"))
        tensors.update({key: t.contiguous().cpu() for key, t in flat.items()})
        nodes.append({"id": node.id, "parent": None if node.parent.is_root else node.parent.id,
                      "namespace": node.namespace, "tokens": node.tokens.tolist(),
                      "checkpoints": list(node.ckpt_pos), "leaf": not node.children,
                      "branched": node.branched, "truncated": node.truncated, "resumed": node.resumed})
    return nodes


def _path(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidInputError(f"path={path!r} must be a file path (a str or os.PathLike)")
    return Path(path)


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # persist the rename too; not every platform can open a directory
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


# -- load ---------------------------------------------------------------------------------------------------------
def load_store(cls: type[PrefixStore], path: str | Path, model: torch.nn.Module, options: dict) -> PrefixStore:
    """A `cls` store for `model` holding what `save_store` wrote to `path`, verified first (module docstring)."""
    path = _path(path)
    check_model_argument(model, "PrefixStore.load")  # (before the file is read: the wrapper's weights are renamed)
    if not path.is_file():
        raise InvalidInputError(f"path={str(path)!r} is not a file written by PrefixStore.save")
    with _opened(path) as file:  # opened once: a save replacing the file meanwhile (os.replace) leaves this one whole
        header = _read_header(path, file)
        fingerprint = _check_model(path, header, model)
        tensors = _read_tensors(path, header, file)
    entries = {tier: _entries(path, nodes, tensors, tier) for tier, nodes in header["tiers"].items()}
    saved = {"capacity": header["capacity_bytes"], "policy": header["policy"], "block_size": header["block_size"]}
    if header["offload_capacity_bytes"] is not None:
        saved["offload_capacity"] = header["offload_capacity_bytes"]
    store = cls(model, **(saved | options))
    try:
        _fingerprints[store] = store.weights, fingerprint
        with store.lock:  # the new store may already be the model's default: other threads wait for the entries
            _restore_alphas(store, header, saved)
            dropped = _admit(store, entries)
    except BaseException as err:
        store.close()  # take the hooks and patches off the model: nothing half-built stays behind
        if isinstance(err, Exception) and (isinstance(err, InvalidInputError) or not isinstance(err, PrefixlabError)):
            raise CorruptStoreError(f"{path} holds inconsistent entries ({err}); save the store again") from err
        raise
    if dropped:
        warnings.warn(f"PrefixStore.load: {path} holds more than the loaded store's capacity: {dropped} of its "
                      f"{sum(map(len, entries.values()))} entries were refused or evicted while loading; raise "
                      "capacity (or offload_capacity) to keep them all", RuntimeWarning, stacklevel=3)
    return store


@contextlib.contextmanager
def _opened(path: Path):
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            yield file
    except SafetensorError as err:
        raise CorruptStoreError(
            f"{path} is not a complete safetensors file ({err}): it is truncated or not a PrefixStore file. "
            "Delete it and save the store again"
        ) from None


def _read_header(path: Path, file) -> dict:
    metadata = file.metadata() or {}
    text, want = metadata.get(HEADER_KEY), metadata.get(HEADER_DIGEST_KEY)
    if text is None:
        raise InvalidInputError(f"{path} has no prefixlab header: it was not written by PrefixStore.save")
    if want is None:
        raise InvalidInputError(f"{path} was written by an older prefixlab without checksums; build the store "
                                "again and save it with this version")
    if digest(text.encode()) != want:
        raise CorruptStoreError(f"the prefixlab header of {path} does not match its checksum: the file is "
                                "corrupted. Delete it and save the store again")
    try:
        header = json.loads(text)
        if header["format"] != FORMAT:
            raise InvalidInputError(f"{path} has store format {header['format']}; this prefixlab reads format "
                                    f"{FORMAT}. Save the store again with this version")
        keys = ("identity", "weights", "capacity_bytes", "offload_capacity_bytes", "policy", "block_size")
        if missing := [key for key in keys if key not in header]:
            raise KeyError(missing)
        if not isinstance(header["weights"], dict) or not isinstance(header["tiers"], dict):
            raise TypeError("weights and tiers must be JSON objects")
        if not isinstance(header["identity"], str):
            raise TypeError("identity must be a string")
        if not set(header["tiers"]) <= set(TIERS):
            raise ValueError(f"tiers {sorted(header['tiers'])}")
        if not all(isinstance(v, list) and len(v) == 3 for v in header["tensors"].values()):
            raise ValueError("tensor records")
        _check_saved_options(header)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        if isinstance(err, PrefixlabError):
            raise
        raise CorruptStoreError(f"the prefixlab header of {path} is malformed ({err!r}); save the store again") \
            from None
    header["tiers"] = {tier: header["tiers"][tier] for tier in TIERS if tier in header["tiers"]}
    return header


def _restore_alphas(store: PrefixStore, header: dict, saved: dict) -> None:
    """A tier loaded as it was saved (policy, block size, its capacity; no `alpha=`) keeps the alpha it had settled
    (tuned or fixed): a tuning is not run twice. Otherwise it tunes anew."""
    same = "alpha" not in store.options and all(store.options[key] == saved[key] for key in ("policy", "block_size"))
    for tier, core, capacity in (("device", store.core, "capacity"), ("host", store.offload, "offload_capacity")):
        alpha = header.get("alpha", {}).get(tier)
        if same and core is not None and alpha is not None and store.options[capacity] == saved.get(capacity):
            settle_alpha(core, alpha)


def _check_saved_options(header: dict) -> None:
    """ValueError unless the saved budget, policy and block size are what save_store writes (a header whose
    checksum matches can still come from something else: that is a corrupt file, not the caller's bad input)."""
    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    offload = header["offload_capacity_bytes"]
    if not (count(header["capacity_bytes"]) and count(header["block_size"]) and (offload is None or count(offload))
            and header["policy"] in POLICY_NAMES):
        raise ValueError(f"saved options capacity_bytes={header['capacity_bytes']!r}, policy={header['policy']!r}, "
                         f"block_size={header['block_size']!r}, offload_capacity_bytes={offload!r}")
    if not settled_alphas_valid(header.get("alpha", {}), TIERS):  # (files saved before alphas were kept have none)
        raise ValueError(f"saved alpha {header['alpha']!r}")


def _check_model(path: Path, header: dict, model: torch.nn.Module) -> dict[str, str]:
    """ModelMismatchError unless `model` has the saved config, dtype and weights; returns its fingerprint."""
    identity = model_identity(model)
    if header["identity"] not in (identity, model_identity(model, output_fields=True)):  # (older files: the latter)
        raise ModelMismatchError(
            f"{path} was saved for a model with identity {header['identity'][:12]}, but this model's config "
            f"and dtype give {identity[:12]}; load it with the model (same config and dtype) that saved it"
        )
    fingerprint, saved = weights_fingerprint(model), header["weights"]
    if fingerprint != saved:
        groups = (("differ", sorted(k for k in saved.keys() & fingerprint.keys() if saved[k] != fingerprint[k])),
                  ("only in the file", sorted(saved.keys() - fingerprint.keys())),
                  ("only in this model", sorted(fingerprint.keys() - saved.keys())))
        details = "; ".join(f"{len(names)} {label}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                            for label, names in groups if names)
        raise ModelMismatchError(
            f"{path} was saved for a model with the same config and dtype but other weights ({details}): a fine-tune "
            "or another checkpoint computes other KV and states, so its entries would give wrong outputs. Load it "
            "with the exact weights that saved it, or start an empty PrefixStore for this model"
        )
    return fingerprint


def _read_tensors(path: Path, header: dict, file) -> dict[str, torch.Tensor]:
    """Every tensor of the open `file` (on the host), each checked against its recorded dtype, shape and digest."""
    expected = header["tensors"]
    names = set(file.keys())
    if names != expected.keys():
        odd = sorted(names ^ expected.keys())
        raise CorruptStoreError(f"{path} holds other tensors than its header lists ({', '.join(odd[:3])}); "
                                "the file is corrupted. Delete it and save the store again")
    tensors = {name: file.get_tensor(name) for name in names}
    for name, hexdigest in tensor_digests(tensors).items():
        if [str(tensors[name].dtype), list(tensors[name].shape), hexdigest] != expected[name]:
            raise CorruptStoreError(
                f"tensor {name!r} in {path} does not match its checksum (dtype, shape or bytes changed since it "
                "was saved): the file is corrupted. Delete it and save the store again"
            )
    return tensors


def _entries(path: Path, nodes: list[dict], tensors: dict[str, torch.Tensor], tier: str) -> list[tuple]:
    """(tokens, kv(a, b), {position: state}, namespace) per saved leaf, tensors on the host."""
    by_node: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith(f"{tier}."):
            by_node.setdefault(name.split(".")[1], {})[name] = tensor
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


def _admit(store: PrefixStore, entries: dict[str, list[tuple]]) -> int:
    """Admit the saved entries, host tier first (into the offload tier, or the device one when the store has none);
    returns how many of them neither tier holds whole afterwards (refused or evicted: they did not fit)."""
    shapes: dict = {}
    for tier, tier_entries in entries.items():
        core = store.offload if tier == "host" and store.offload is not None else store.core
        device, pin = (store.device, False) if core is store.core else ("cpu", torch.cuda.is_available())
        for tokens, kv, states, namespace, _ in tier_entries:
            for position, state in states.items():  # what PrefixStore.admit checks, and one shape per tensor kind
                check_state(state, store.layout, f"the state at {position}")
                _same_shapes(shapes, "conv", state.conv)
                _same_shapes(shapes, "recurrent", state.recurrent)
            core.admit(tokens, kv=_moved(kv, device, pin, store, shapes),
                       states={p: s.to(device, pin) for p, s in states.items()}, namespace=namespace, restore=True)
        _restore_marks(core, tier_entries)
    tiers = [core for core in (store.core, store.offload) if core is not None]
    return sum(not any(core.peek(tokens, namespace)[1] == len(tokens) for core in tiers)
               for tier_entries in entries.values() for tokens, _, _, namespace, _ in tier_entries)


def _marks(chain: list[dict]) -> dict[int, tuple[bool, bool, int]]:
    """{end position: (branched, truncated, resumed)} of the saved nodes on a leaf's path (files before these marks:
    none), which strict budgets read (cache/strict.py): a branch point requests resumed from, a leaf cut short."""
    marks, end = {}, 0
    for node in reversed(chain):
        end += len(node["tokens"])
        saved = (bool(node.get("branched", False)), bool(node.get("truncated", False)), node.get("resumed", 0))
        if saved != (False, False, 0):
            if not is_int(saved[2]) or saved[2] < 0:
                raise ValueError(f"node {node['id']} has resumed={saved[2]!r}")
            marks[end] = saved
    return marks


def _restore_marks(core: PrefixCacheCore, tier_entries: list[tuple]) -> None:
    """Put the saved marks back on the nodes that end where the saved ones ended (an entry refused or cut while
    loading keeps none beyond what it holds)."""
    for tokens, _, _, namespace, marks in tier_entries:
        if marks:
            walk = core.tree.walk(np.asarray(tokens, dtype=np.int64), namespace)
            for node in walk.path[1:]:
                if node.end in marks and node.end <= walk.shared_length:
                    node.branched, node.truncated, node.resumed = marks[node.end]


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
