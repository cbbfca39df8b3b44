"""Saving and loading a PrefixStore (`store.save(path)`, `PrefixStore.load(path, model)`): one safetensors file.

What a file holds
  tensors   "<tier>.n<node id>.k.<layer>" / ".v.<layer>" (the KV of a node's edge) and
            "<tier>.n<node id>.s<position>.conv|recurrent.<layer>.<i>" (its checkpoints), tier "device" or "host"
            (the offload tier). A prefix shared by many entries is written once.
  metadata  "prefixlab": the JSON header: format, model identity (config + dtype, cache/model_info.py), the weights
            fingerprint, the store's options, each tier's settled alpha (kept when loaded with the same options),
            nodes (id, parent, namespace, tokens, checkpoints, marks; parents first) and policy state (recency,
            dp's laws...: cache/restore.py; null while alpha is still tuning), and each tensor's dtype, shape and
            BLAKE2b digest of its bytes as written;
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

Restart. A tier loaded as it was saved (policy, block size, its capacity, no `alpha=`) with a policy state is
rebuilt as it was, node for node, and serves on exactly as the saved store would have (cache/restore.py; the
`policy_state` of the header). Otherwise (files from before the policy state, other options, a tier saved while
tuning alpha, or holding more than the loaded budget: saved with overflow=True, loaded without) every saved leaf's
path is re-admitted, which keeps the entries but not how the policy weighs them.

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

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from prefixlab.cache.alpha import settle_alpha, settled_alpha, settled_alphas_valid
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.defaults import check_model_argument
from prefixlab.cache.digests import digest, tensor_digests
from prefixlab.cache.model_info import model_identity
from prefixlab.cache.persist_entries import admit_entries, saved_entries, saved_nodes
from prefixlab.cache.policies import POLICY_NAMES
from prefixlab.cache.restore import check_admission_state, check_policy_state, policy_state, preorder
from prefixlab.cache.tensors import kv_to_flat, state_to_flat
from prefixlab.errors import CorruptStoreError, InvalidInputError, ModelMismatchError, PrefixlabError

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
        "policy_state": {tier: policy_state(core, list(preorder(core.tree)))
                         for tier, core in (("device", store.core), ("host", store.offload)) if core is not None},
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
    for node in preorder(core.tree):  # (parents first, siblings in order: how a load rebuilds the tree)
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
    entries = {tier: saved_entries(path, nodes, tensors, tier) for tier, nodes in header["tiers"].items()}
    _check_admission_states(path, header, model)
    saved = {"capacity": header["capacity_bytes"], "policy": header["policy"], "block_size": header["block_size"]}
    if header["offload_capacity_bytes"] is not None:
        saved["offload_capacity"] = header["offload_capacity_bytes"]
    store = cls(model, **(saved | options))
    try:
        _fingerprints[store] = store.weights, fingerprint
        with store.lock:  # the new store may already be the model's default: other threads wait for the entries
            _restore_alphas(store, header, saved)
            rebuilt = {tier: (saved_nodes(path, header["tiers"][tier], tensors, tier), state)
                       for tier, state in _policy_states(store, header, saved).items()}
            dropped = admit_entries(store, entries, rebuilt)
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
    for tier, core in _loaded_as_saved(store, saved).items():
        if (alpha := header.get("alpha", {}).get(tier)) is not None:
            settle_alpha(core, alpha)


def _policy_states(store: PrefixStore, header: dict, saved: dict) -> dict[str, dict]:
    """{tier: its saved policy state} of the tiers to rebuild as saved (cache/restore.py): loaded as saved, with the
    alpha settled (`_restore_alphas` first), and holding only that tier's entries (a store without the offload tier
    admits the host entries into the device one: both re-admitted). Files without policy states have none."""
    loaded = _loaded_as_saved(store, saved)
    if "host" in header["tiers"] and store.offload is None:
        loaded.pop("device", None)
    return {tier: state for tier, core in loaded.items()
            if (state := header.get("policy_state", {}).get(tier)) is not None and core.bootstrap is None}


def _check_admission_states(path: Path, header: dict, model: torch.nn.Module) -> None:
    """CorruptStoreError unless each saved policy state's admission part is one the saved policy restores (checked
    whether or not the load restores it: a damaged file is refused whatever the options it is loaded with)."""
    for tier, state in header.get("policy_state", {}).items():
        if state is not None:
            try:
                check_admission_state(state, header["policy"], ModelSpec.from_config(model.config, dtype=model.dtype),
                                      header["block_size"], {node["id"] for node in header["tiers"][tier]})
            except (ValueError, KeyError, TypeError, InvalidInputError) as err:
                raise CorruptStoreError(f"the {tier} policy state of {path} is malformed ({err!r}); save the store "
                                        "again") from None


def _loaded_as_saved(store: PrefixStore, saved: dict) -> dict[str, PrefixCacheCore]:
    """{tier: core} of the tiers the store has with the options they were saved with (policy, block size, the
    tier's capacity; no `alpha=`)."""
    if "alpha" in store.options or any(store.options[key] != saved[key] for key in ("policy", "block_size")):
        return {}
    return {tier: core for tier, core, capacity in (("device", store.core, "capacity"),
                                                    ("host", store.offload, "offload_capacity"))
            if core is not None and store.options[capacity] == saved.get(capacity)}


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
    states = header.get("policy_state", {})  # (nor policy states, before those were kept)
    if not isinstance(states, dict) or not set(states) <= set(header["tiers"]):
        raise ValueError(f"policy states of tiers {list(states) if isinstance(states, dict) else states!r}")
    for tier, state in states.items():
        if state is not None:
            check_policy_state(state, len(header["tiers"][tier]))


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
