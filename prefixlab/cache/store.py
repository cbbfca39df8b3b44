"""PrefixStore: the persistent, shared part of prefix reuse for one Hugging Face model.

    store = PrefixStore(model, capacity="4GB", policy="dp")
    model.generate(input_ids, past_key_values=HybridPrefixCache(store), max_new_tokens=64)

The store owns a `PrefixCacheCore` (radix tree + admission/eviction policy + byte budget; cache/core.py) whose
payloads are tensors (cache/tensors.py), an optional host-memory tier for entries evicted from the device, and the
forward hooks through which the model drives every `HybridPrefixCache` (see cache/hf.py for the request life cycle).
Policy lives in the core only; this file moves tensors and counts bytes.

Threads: one store may serve `generate` calls from several threads at once (a threaded server). Every change to the
core, the host tier, the open caches and the counters happens under the store's re-entrant `lock`, held only for
bookkeeping and tensor copies, never across a model forward, so forwards run concurrently (cache/sharing.py). A
cache is committed by whichever thread uses the store next, but only between its forwards (never mid-forward).
One HybridPrefixCache serves one request: never pass the same cache object to two threads at once.
"""

from __future__ import annotations

import json
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.model_info import (  # noqa: F401  (re-exported: part of the store's API)
    STATE_DROPPING_MODEL_TYPES,
    CacheLayout,
    model_identity,
    parse_capacity,
)
from prefixlab.cache.sharing import check_open, guard_forward, serialized, unguard_forward
from prefixlab.cache.tensors import (
    TensorKV,
    TensorState,
    kv_from_flat,
    kv_to_flat,
    path_kv,
    state_from_flat,
    state_to_flat,
)
from prefixlab.errors import InvalidInputError, ModelMismatchError, UnsupportedModelError


class PrefixStore:
    """Cached prefixes of one model, shared by every `HybridPrefixCache(store)`.

    Args:
        model: a transformers causal LM (the store installs forward hooks on it).
        capacity: device byte budget, an int or a string such as "4GB" / "512MiB".
        policy: admission policy of the core ("dp", "marconi", "sglang+", "vllm+").
        offload_capacity: optional host-memory budget; entries evicted from the device move there first.
        block_size: token granularity of the policies.
        patch: route the model's linear-attention layers through prefixlab.recurrent kernels (exact), so states are
            captured inside the one prefill pass and Jamba-style layers resume from cached states; `close()` undoes
            it. With patch=False transformers' layers run and planned states are captured by splitting the prefill
            (a model another store patched stays patched while this one is open).

    Thread-safe: several threads may run `generate` with their own HybridPrefixCache over one store; model forwards
    run concurrently, store bookkeeping is serialised by `lock` (see the module docstring). After `close()` every
    method raises StoreClosedError.
    """

    _defaults: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _defaults_lock = threading.Lock()

    def __init__(self, model: torch.nn.Module, capacity: int | str = "4GB", policy: str = "dp", *,
                 offload_capacity: int | str | None = None, block_size: int = 32, patch: bool = True,
                 **core_options):
        if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
            raise InvalidInputError(f"model must be a transformers model, got {type(model).__name__}")
        already_patched = bool(getattr(model, "prefixlab_patched", False))
        model_type = getattr(model.config, "model_type", "")
        if model_type in STATE_DROPPING_MODEL_TYPES and not (patch or already_patched):
            raise UnsupportedModelError(
                f"{type(model).__name__}: {STATE_DROPPING_MODEL_TYPES[model_type]}; prefixes cannot be reused exactly "
                "unless its layers are patched: keep patch=True or call prefixlab.recurrent.patch(model) first"
            )
        self.model = model
        self.lock = threading.RLock()  # serialises every change to the store (never held across a forward)
        self.closed = False
        self.identity = model_identity(model)
        self.layout = CacheLayout.from_config(model.config)
        self.spec = ModelSpec.from_config(model.config, dtype=model.dtype)
        self.capacity_bytes = parse_capacity(capacity)
        self.core = PrefixCacheCore(self.capacity_bytes, policy=policy, spec=self.spec, block_size=block_size,
                                    **core_options)
        self.offload = None
        self._host_matches: set[int] = set()  # ids of live matches that came from the host tier
        if offload_capacity is not None:
            self.offload = PrefixCacheCore(parse_capacity(offload_capacity, "offload_capacity"), policy=policy,
                                           spec=self.spec, block_size=block_size, **core_options)
            self._evict_to_host(self.core.eviction)
        # caches whose tokens are not admitted yet; held strongly, as generate() drops its cache when it returns
        self._open: dict[int, HybridPrefixCache] = {}
        self._counters = {"sequences": 0, "hit_sequences": 0, "reused_tokens": 0, "reused_bytes": 0,
                          "offload_hits": 0}
        self._cache_arg = "cache_params" if "cache_params" in _forward_parameters(model) else "past_key_values"
        # last, so that a store refused above leaves the model as it was
        self._holds_patch = _hold_patch(model, patch)
        guard_forward(model)
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True),
        ]

    @classmethod
    def default_for(cls, model: torch.nn.Module, **options) -> PrefixStore:
        """The model's default store, created on first call with `options` (later calls must not pass options)."""
        with cls._defaults_lock:
            store = cls._defaults.get(model)
            if store is None or store.closed:
                store = cls._defaults[model] = cls(model, **options)
            elif options:
                raise InvalidInputError("the default store of this model already exists; options apply only at "
                                        "creation")
            return store

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def records_in_kernel(self) -> bool:
        """Whether the model's recurrent layers report states mid-forward (prefixlab.recurrent.patch)."""
        return bool(getattr(self.model, "prefixlab_patched", False))

    def close(self) -> None:
        """Admit what open caches hold, remove the hooks from the model and give back the patch (the model is
        unpatched when no other store holds it). Call it once no request runs; later uses raise StoreClosedError."""
        with self.lock:
            if self.closed:
                return
            try:
                self.flush()
            finally:
                self.closed = True
                for handle in self._hooks:
                    handle.remove()
                self._hooks = []
                unguard_forward(self.model)
                if self._holds_patch:
                    from prefixlab.recurrent.patch import let_go

                    let_go(self.model)
                    self._holds_patch = False

    # -- what HybridPrefixCache calls -------------------------------------------------------------------------------
    @serialized
    def match(self, tokens: Sequence[int], namespace: str = "default"):
        """Longest reusable prefix of `tokens` on the device (locked until `release`); admits open caches first."""
        self.flush()
        return self.core.match(tokens, namespace=namespace)

    @serialized
    def match_offloaded(self, tokens: Sequence[int], namespace: str, longer_than: int):
        """A host-tier match reusing more than `longer_than` tokens (locked until `release`), else None."""
        if self.offload is None:
            return None
        match = self.offload.match(tokens, namespace=namespace)
        if match.length > longer_than:
            self._counters["offload_hits"] += 1
            self._host_matches.add(id(match))
            return match
        self.offload.release(match)
        return None

    @serialized
    def lookup(self, tokens: Sequence[int], namespace: str = "default") -> tuple:
        """(device match, match to load from: the host tier's when it reuses more, else the device one); both stay
        locked until `release_lookup`."""
        match = self.match(tokens, namespace)
        try:
            return match, self.match_offloaded(tokens, namespace, longer_than=match.length) or match
        except BaseException:
            self.release(match)
            raise

    @serialized
    def release_lookup(self, match, source) -> None:
        """Unlock what `lookup` returned."""
        self.release(match)
        if source is not match:
            self.release(source)

    @serialized
    def plan(self, tokens: Sequence[int], match) -> list[int]:
        return self.core.plan(tokens, match)

    @serialized
    def release(self, match) -> None:
        """Unlock a match of either tier."""
        if id(match) in self._host_matches:
            self._host_matches.discard(id(match))
            self.offload.release(match)
        else:
            self.core.release(match)

    def forward_failed(self, cache: HybridPrefixCache) -> None:
        """A forward given `cache` raised (any exception): forget its request; nothing of it is admitted."""
        with self.lock:
            cache.forward_failed()
            self._open.pop(id(cache), None)

    def _evict_to_host(self, eviction) -> None:
        """Before the device policy frees a victim, copy its whole path (tokens up to the victim's end, their KV and
        the victim's checkpoints) into the host tier, which admits or drops it under its own budget."""
        free_on_device = eviction.free
        pin = torch.cuda.is_available()

        def free(node, want_bytes: int) -> int:
            path = []
            while not node.is_root:
                path.append(node)
                node = node.parent
            path.reverse()
            tokens = [t for n in path for t in n.tokens.tolist()]
            states = {p: s.to("cpu", pin) for p, s in zip(path[-1].ckpt_pos, path[-1].ckpt_state, strict=True)}
            kv_on_device = path_kv([n.kv for n in path])
            self.offload.admit(tokens, kv=lambda a, b: kv_on_device(a, b).to("cpu", pin), states=states,
                               namespace=path[-1].namespace)
            return free_on_device(path[-1], want_bytes)

        eviction.free = free

    @serialized
    def record_reuse(self, reused_tokens: int, rows: int) -> None:
        self._counters["sequences"] += rows
        self._counters["hit_sequences"] += rows if reused_tokens else 0
        self._counters["reused_tokens"] += reused_tokens * rows
        self._counters["reused_bytes"] += rows * (reused_tokens * self.spec.kv_bytes_per_token
                                                  + (self.spec.state_bytes if reused_tokens else 0))

    @serialized
    def admit(self, tokens: Sequence[int], kv: Callable[[int, int], TensorKV], states: dict[int, TensorState],
              namespace: str = "default") -> bool:
        """Offer a sequence, its KV (by token range) and states at some positions to the admission policy.
        Returns False (with a warning: the request simply ran uncached) when the budget cannot hold it."""
        admitted = self.core.admit(tokens, kv=kv, states=states, namespace=namespace)
        if not admitted:
            warnings.warn(
                f"PrefixStore: a {len(tokens)}-token entry does not fit in capacity={self.capacity_bytes} bytes "
                "(or everything else is in use); that request ran uncached. Raise the capacity to reuse it",
                RuntimeWarning,
                stacklevel=2,
            )
        return admitted

    @serialized
    def flush(self) -> None:
        """Admit everything open caches hold now (their requests may go on; later tokens are admitted later)."""
        open_caches, self._open = list(self._open.values()), {}
        for cache in open_caches:
            cache.commit()

    @serialized
    def stats(self) -> dict:
        """Core statistics (bytes, checkpoints, evictions...) plus reuse per sequence served: sequences,
        hit_sequences, reused_tokens and reused_bytes (KV + state bytes loaded from the store)."""
        self.flush()
        host = self.offload.stats() if self.offload else {}
        offload = {f"offload_{k}": v for k, v in host.items() if k.endswith("bytes")}
        return {**self.core.stats(), **offload, **self._counters}

    # -- persistence ------------------------------------------------------------------------------------------------
    @serialized
    def save(self, path: str | Path) -> None:
        """Write every cached entry (tokens, KV, checkpoints, per namespace) and the model identity to a
        safetensors file. Shared prefixes are written once."""
        self.flush()
        tensors, nodes = {}, []
        for node in self.core.tree.nodes():
            if node.is_root:
                continue
            name = f"n{node.id}"
            if node.kv is not None:
                tensors.update(kv_to_flat(node.kv, name))
            for position, state in zip(node.ckpt_pos, node.ckpt_state, strict=True):
                tensors.update(state_to_flat(state, f"{name}.s{position}"))
            nodes.append({"id": node.id, "parent": None if node.parent.is_root else node.parent.id,
                          "namespace": node.namespace, "tokens": node.tokens.tolist(),
                          "checkpoints": list(node.ckpt_pos), "leaf": not node.children})
        header = {"identity": self.identity, "capacity_bytes": self.capacity_bytes, "policy": self.core.policy,
                  "block_size": self.core.options.block_size, "nodes": nodes}
        save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(path),
                  metadata={"prefixlab": json.dumps(header)})

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module, **options) -> PrefixStore:
        """A store for `model` holding what `save` wrote (re-admitted path by path through the policy). `options`
        override the saved capacity / policy / block_size. ModelMismatchError if the file is for another model."""
        path = Path(path)
        if not path.is_file():
            raise InvalidInputError(f"path={str(path)!r} is not a file written by PrefixStore.save")
        with safe_open(str(path), framework="pt", device=str(model.device)) as file:
            header = json.loads((file.metadata() or {}).get("prefixlab", "null") or "null")
            if header is None:
                raise InvalidInputError(f"{path} has no prefixlab header: it was not written by PrefixStore.save")
            identity = model_identity(model)
            if header["identity"] != identity:
                raise ModelMismatchError(
                    f"{path} was saved for a model with identity {header['identity'][:12]}, but this model's config "
                    f"and dtype give {identity[:12]}; load it with the model (same config and dtype) that saved it"
                )
            tensors = {name: file.get_tensor(name) for name in file.keys()}
        store = cls(model, **({"capacity": header["capacity_bytes"], "policy": header["policy"],
                                "block_size": header["block_size"]} | options))
        by_id = {node["id"]: node for node in header["nodes"]}
        for leaf in (node for node in header["nodes"] if node["leaf"]):
            path_nodes = [leaf]
            while path_nodes[-1]["parent"] is not None:
                path_nodes.append(by_id[path_nodes[-1]["parent"]])
            path_nodes.reverse()
            tokens, pieces, states, depth = [], [], {}, 0
            for node in path_nodes:
                name, depth = f"n{node['id']}", depth + len(node["tokens"])
                tokens += node["tokens"]
                pieces.append(kv_from_flat(tensors, name, len(node["tokens"])))
                states.update({p: state_from_flat(tensors, f"{name}.s{p}") for p in node["checkpoints"]})
            store.admit(tokens, path_kv(pieces), states, path_nodes[0]["namespace"])
        return store

    # -- forward hooks: how generate() drives HybridPrefixCache ------------------------------------------------------
    def _our_cache(self, module: torch.nn.Module, kwargs: dict) -> HybridPrefixCache | None:
        cache = kwargs.get(self._cache_arg, kwargs.get("past_key_values"))
        if not isinstance(cache, HybridPrefixCache) or cache.store is self:
            return cache if isinstance(cache, HybridPrefixCache) else None
        if cache.store.model is module:
            return None  # another store on this model drives it
        raise ModelMismatchError(
            f"a HybridPrefixCache built for another model ({cache.store.identity[:12]}, "
            f"{cache.store.model.dtype}) was passed to this one ({self.identity[:12]}, {self.model.dtype}); "
            "config or dtype differ. Use a HybridPrefixCache over this model's store"
        )

    def _before_forward(self, module, args: tuple, kwargs: dict):
        cache = self._our_cache(module, kwargs)
        if cache is None:
            return None
        check_open(self)
        try:
            return self._prepare(module, cache, args, kwargs)
        except BaseException:  # the forward will not run: the cache must not look half begun
            self.forward_failed(cache)
            raise

    def _prepare(self, module, cache: HybridPrefixCache, args: tuple, kwargs: dict):
        if cache.in_flight:  # its last forward died where neither hook nor guard saw it (an interrupt between them)
            raise InvalidInputError(
                "this HybridPrefixCache's previous forward was interrupted before it ended, so generate() was told a "
                "wrong cache length; the cache is reset now: run the request again (or use a new cache)"
            )
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise InvalidInputError("with HybridPrefixCache, pass model inputs by keyword (input_ids=...)")
            kwargs = {"input_ids": args[0], **kwargs}
        if self._cache_arg != "past_key_values" and kwargs.get("past_key_values") is cache:
            kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"} | {self._cache_arg: cache}
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise InvalidInputError(
                "HybridPrefixCache needs input_ids: inputs_embeds cannot be matched against cached tokens"
            )
        if not cache.started:
            kwargs = self._start(module, cache, kwargs)
        with self.lock:  # a commit by another thread sees the cache before or after this, never halfway
            cache.record(kwargs["input_ids"])
        return (), kwargs

    def _start(self, module, cache: HybridPrefixCache, kwargs: dict) -> dict:
        """Begin the request, run the prefill up to each planned capture split, return the last segment's kwargs."""
        length = kwargs["input_ids"].shape[1]
        with self.lock:
            start = cache.begin(kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"))
        for stop in cache.capture_splits(start, length):
            segment = _slice_inputs(kwargs, start, stop, length)
            if "logits_to_keep" in _forward_parameters(module):
                segment["logits_to_keep"] = 1  # only the states matter here
            module(**segment)
            start = stop
        return _slice_inputs(kwargs, start, length, length)

    def _after_forward(self, module, args: tuple, kwargs: dict, output) -> None:
        cache = kwargs.get(self._cache_arg, kwargs.get("past_key_values"))
        if not isinstance(cache, HybridPrefixCache) or cache.store is not self or not cache.started:
            return
        if output is None:  # the forward raised an Exception (sharing.guard_forward catches the others)
            self.forward_failed(cache)
            return
        with self.lock:
            cache.forward_done()
            self._open[id(cache)] = cache


def _hold_patch(model: torch.nn.Module, apply: bool) -> bool:
    """Route the model's linear-attention layers through prefixlab kernels, which resume any forward from the cached
    states and record planned states inside the one prefill pass (exact: tests/test_recurrent_patch*.py); shared with
    the other stores on the model (recurrent/patch.py `hold`). Returns whether this store holds a share."""
    from prefixlab.recurrent.patch import hold

    try:
        return hold(model, apply)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(
            f"{err}. Build the store with patch=False to keep transformers' own layers (planned states are then "
            "captured by splitting the prefill at them)"
        ) from err


def _forward_parameters(module: torch.nn.Module) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(module.forward).parameters)


def _slice_inputs(kwargs: dict, start: int, stop: int, length: int) -> dict:
    """Model inputs for tokens [start, stop) of a `length`-token call: per-token inputs are cut, the 2D attention
    mask keeps every column up to `stop` (it spans cached + new tokens)."""
    out = dict(kwargs)
    for name in ("input_ids", "position_ids", "token_type_ids"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == length:
            out[name] = value[..., start:stop]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out["attention_mask"] = mask[:, :stop]
    return out
