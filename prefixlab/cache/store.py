"""PrefixStore: the persistent, shared part of prefix reuse for one Hugging Face model.

    store = PrefixStore(model, capacity="4GB", policy="dp")
    model.generate(input_ids, past_key_values=HybridPrefixCache(store), max_new_tokens=64)

The store owns a `PrefixCacheCore` (radix tree + policy + byte budget; cache/core.py) of tensor payloads
(cache/tensors.py) and an optional host-memory tier for entries evicted from the device. Its forward hooks
(cache/hooks.py) let the model drive every `HybridPrefixCache` (cache/hf.py); it calls a cache only to `commit()`
those it holds for admission. Policy lives in the core only; this file moves tensors and counts bytes.

Threads: one store may serve `generate` calls from several threads at once. Every change to its state happens under
its re-entrant `lock`, never held across a model forward (cache/sharing.py); a cache is committed by whichever
thread uses the store next, between its forwards. Never pass one HybridPrefixCache to two threads at once.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.defaults import check_store_arguments, default_for, normalize_option, register, unregister
from prefixlab.cache.devices import execution_device, layer_devices
from prefixlab.cache.entry_shapes import EntryShapes
from prefixlab.cache.explain import why
from prefixlab.cache.hfspec import selection_limit
from prefixlab.cache.hooks import attach
from prefixlab.cache.media_memo import MEDIA_CACHE_BYTES
from prefixlab.cache.model_info import (  # noqa: F401  (re-exported: part of the store's API)
    STATE_DROPPING_MODEL_TYPES,
    CacheLayout,
    check_config_still_served,
    check_deterministic,
    decode_differs_from_prefill,
    model_identity,
    numeric_context,
    pads_change_states,
    parse_capacity,
    rope_limit,
)
from prefixlab.cache.ownership import hold_patch, patch_replaced_layers, release_collected, release_when_collected
from prefixlab.cache.persist import load_store, save_store
from prefixlab.cache.reuse_counts import ReuseCounts
from prefixlab.cache.sharing import serialized
from prefixlab.cache.tensors import (
    TensorKV,
    TensorState,
    owning_state,
    spill_evictions,
)
from prefixlab.cache.tokens import as_states, as_tokens
from prefixlab.cache.walk import KeptWalk
from prefixlab.cache.weights import watch_optimizer_steps, weights_version
from prefixlab.errors import InvalidInputError, UnsupportedModelError, check_bool, is_int


class PrefixStore(ReuseCounts):
    """Cached prefixes of one model, shared by every `HybridPrefixCache(store)`. The first open store of a model is
    its default store: `HybridPrefixCache()` without a store binds to it (see `default_for`).

    Args:
        model: a transformers causal LM (the store installs forward hooks on it).
        capacity: device byte budget, an int or a string such as "4GB" / "512MiB".
        policy: admission policy of the core ("dp", "marconi", "sglang+", "vllm+", "marconi+balanced|block|log").
        offload_capacity: optional host-memory budget; entries evicted from the device move there first.
        block_size: token granularity of the policies.
        patch: route the model's linear-attention layers through prefixlab.recurrent kernels (exact), so states are
            captured inside the one prefill pass and Jamba-style layers resume from cached states; `close()` undoes
            it. With patch=False transformers' layers run and planned states are captured by splitting the prefill
            (a model another store patched stays patched while this one is open).
        media_cache: bytes of encoded images kept by their pixels, where images are keyed by content (Qwen3.5), so a
            repeated image skips the vision tower (cache/media_memo.py); default "256MiB"; 0 keeps none.
        core_options: PrefixCacheCore's keyword options (alpha, checkpoint_budget, history_tokens, ...);
            tuning_lag_requests defaults to None here: alpha is tuned in a background thread and applied once found
            (an int n: n admissions later, deterministic; 0: inline, as the simulator).

    Thread-safe (see the module docstring). After `close()` every method raises StoreClosedError.
    """

    def __init__(self, model: torch.nn.Module, capacity: int | str = "4GB", policy: str = "dp", *,
                 offload_capacity: int | str | None = None, block_size: int = 32, patch: bool = True,
                 media_cache: int | str = MEDIA_CACHE_BYTES, **core_options):
        check_store_arguments(model, patch, core_options)
        self.model = model
        self.lock = threading.RLock()  # serialises every change to the store (never held across a forward)
        self.identity = model_identity(model)
        self.dtype = model.dtype  # of every tensor the store holds (cache/defaults.py check_unconverted)
        # the cost reader first: where it refuses a model it says why in the family's terms (which config to use)
        self.spec = ModelSpec.from_config(model.config, dtype=model.dtype)
        self.layout = CacheLayout.from_config(model.config)
        # why its layers must stay patched, if so (a config of such a family may have no recurrent layer)
        self._patched_only = (STATE_DROPPING_MODEL_TYPES.get(getattr(model.config, "model_type", ""))
                              if self.layout.state_layers else None)
        # decode steps compute differently from prefills: only prefills are admitted (see decode_differs_from_prefill)
        self.decode_differs = decode_differs_from_prefill(model)
        # the fewest tokens of a prompt a lookup leaves to compute: 1 yields the logits; there, 1 over a cached state
        # would run as a decode step, so 2
        self.min_prefill_tokens = 2 if self.decode_differs else 1
        self.capacity_bytes = parse_capacity(capacity)
        offload_bytes = None if offload_capacity is None else parse_capacity(offload_capacity, "offload_capacity")
        # alpha tuned in a background thread: no admission waits for the tuner's replays (cache/alpha.py)
        core_options = {"explain": True, "tuning_lag_requests": None} | core_options
        # what the store was built with, as `HybridPrefixCache(**options)` compares them
        self.options = {"capacity": self.capacity_bytes, "policy": policy, "offload_capacity": offload_bytes,
                        "block_size": block_size, "patch": patch, "media_cache": normalize_option("media_cache",
                                                                                                   media_cache),
                        **core_options}
        self._host_matches: set[int] = set()  # ids of live matches that came from the host tier
        self.walk = KeptWalk()  # the model's module walk, read by the per-request checks (cache/walk.py)
        watch_optimizer_steps()  # (fused optimizers write weights without a version count)
        self._build_tiers()
        self._note_weights()
        # caches whose tokens are not admitted yet; held strongly, as generate() drops its cache when it returns
        self._open: dict[int, object] = {}
        self.generation = 0  # bumped by clear(): caches that began before it admit nothing (HybridPrefixCache.commit)
        self._start_counts()
        self.closed = False
        # last, so that a store refused above leaves the model as it was: its share of the kernel patch and of the
        # hooks, given back by close() or when the store is collected
        release_collected()  # (what stores collected without close() held, first)
        holds_patch = hold_patch(model, patch)
        attach(model, self, self.options["media_cache"])
        self._release = release_when_collected(self, model, holds_patch)
        register(self)  # the model's default store if it has none (cache/defaults.py)

    @classmethod
    def default_for(cls, model: torch.nn.Module, **options) -> PrefixStore:
        """The model's default store (its first open one), created with `options` if it has none (one store however
        many threads ask at once). Options given for an existing default store must equal the ones it was built with
        (InvalidInputError naming them): one device budget per model, which every cache without a store shares."""
        return default_for(cls, model, options)

    @property
    def device(self) -> torch.device:
        """Where the model computes (its execution device where accelerate offloads its weights)."""
        return execution_device(self.model)

    @property
    def weights(self) -> tuple:
        """The weights version (`weights_version`) the store's entries were computed with."""
        return self._weights

    @property
    def records_in_kernel(self) -> bool:
        """Whether the model's recurrent layers report states mid-forward (prefixlab.recurrent.patch)."""
        return bool(getattr(self.model, "prefixlab_patched", False))

    def close(self) -> None:
        """Admit what open caches hold, take the store's hooks off the model (unless another store or
        `prefixlab.patch` still needs them) and give back its share of the kernel patch (the model is unpatched when
        no other owner holds it). Idempotent. Call it once no request runs; later uses raise StoreClosedError."""
        with self.lock:
            if self.closed:
                return
            try:
                self.flush()
            finally:
                self.closed = True
                unregister(self)
                self._release()  # hooks and patch share back (once: a weakref.finalize), with collected stores'
                release_collected()

    def _build_tiers(self) -> None:
        """Empty device (and host) tiers from `options`."""
        options = dict(self.options)
        capacity, offload_bytes = options.pop("capacity"), options.pop("offload_capacity")
        policy, block_size = options.pop("policy"), options.pop("block_size")
        options.pop("patch"), options.pop("media_cache")
        self.core = PrefixCacheCore(capacity, policy=policy, spec=self.spec, block_size=block_size, **options)
        self.offload = None
        if offload_bytes is not None:
            self.offload = PrefixCacheCore(offload_bytes, policy=policy, spec=self.spec, block_size=block_size,
                                           **options)
            spill_evictions(self.core.eviction, self.offload)

    @serialized
    def clear(self) -> None:
        """Drop every entry of both tiers and what open caches hold: after the model's weights changed (the store
        also does it by itself at the next lookup: an optimizer step or load_state_dict bumps the weights' version
        counters). Between requests: refused while a request holds a match. Counters (`stats()`) are kept."""
        if self._requests_running():
            raise InvalidInputError("PrefixStore.clear() while a request holds cached entries; call it between "
                                    "requests")
        self._open, self._host_matches = {}, set()
        self.generation += 1
        self._build_tiers()
        self._note_weights()

    def __reduce__(self):  # copy.copy, copy.deepcopy and pickle: a copy would share the model's hooks and patch
        raise InvalidInputError("a PrefixStore is not copied or pickled; store.save(path) writes its entries and "
                                "PrefixStore.load(path, model) reads them back")

    def _note_weights(self) -> None:  # what the entries are computed with (and what only runs exactly uncached)
        self._weights, self.pads_change_states = weights_version(self.model, self.walk), pads_change_states(self.model)
        self.rope_limit, self._numerics = rope_limit(self.model), numeric_context()
        # tokens past which a forward's length changes what they compute (a rescaling RoPE from its limit on, a DSA
        # indexer's tie-breaks: hfspec.selection_limit): nothing past them is looked up, resumed or admitted
        self.admit_limit = min(float("inf") if self.rope_limit is None else self.rope_limit - 1,
                               selection_limit(self.model.config) or float("inf"))
        self.identity = model_identity(self.model)
        self.entry_shapes = EntryShapes(self.model.config, self.model.dtype)  # what admit() takes (the config's)

    def _requests_running(self) -> bool:  # some request holds a match (a live lookup) in either tier
        return bool(self.core._live or (self.offload is not None and self.offload._live))

    @serialized
    def check_weights(self, serving: bool = True) -> None:
        """Entries computed with other weights (or float32 matmul precision) are stale: drop them all before anything
        is admitted or reused (once per request, before its lookups: HybridPrefixCache.begin,
        hydragen_cache_from_store; `serving`: and refuse a model with modules in training mode, before anything is
        dropped). A model that resumes exactly only patched must still be (an `unpatch`, or a `with patched(model):`
        block ended)."""
        serving = check_bool("serving", serving)
        identity = model_identity(self.model)
        if identity != self.identity:
            check_config_still_served(self.model, self.layout)
        if self._patched_only and not self.records_in_kernel:
            raise UnsupportedModelError(f"{type(self.model).__name__}: {self._patched_only}; its layers' patch was "
                                        "taken off while this store was open: prefixlab.recurrent.patch(model) "
                                        "again, or close the store and build a new one")
        weights = weights_version(self.model, self.walk)
        if self.records_in_kernel:  # (after weights_version: the walk it keeps is the model's tree now)
            patch_replaced_layers(self.model, self.walk)
        if serving:
            check_deterministic(self.model, self.walk.modules(self.model))  # (submodules in training mode too)
        changed = ("the model's config" if identity != self.identity else
                   "the model's weights" if weights != self._weights else
                   "the float32 matmul precision (TF32 / bf16 settings)" if numeric_context() != self._numerics else
                   None)
        if changed:
            if self._requests_running():
                raise InvalidInputError(
                    f"{changed} changed while requests were running over this PrefixStore; its entries are stale: "
                    "finish those requests, then call store.clear()")
            self.clear()
            warnings.warn(f"PrefixStore: {changed} changed since its entries were computed; the store was emptied "
                          "(its entries would not match what the model computes now)", RuntimeWarning, stacklevel=3)

    # -- what HybridPrefixCache calls -------------------------------------------------------------------------------
    @serialized
    def match(self, tokens: Sequence[int], namespace: str = "default"):
        """Longest reusable prefix of `tokens` on the device (locked until `release`); admits open caches first."""
        self.flush(lookup=True)
        return self.core.match(tokens, namespace=namespace)

    @serialized
    def match_offloaded(self, tokens: Sequence[int], namespace: str, longer_than: int, count: bool = True):
        """A host-tier match reusing more than `longer_than` tokens (locked until `release`), else None; `count`: as
        an offload hit in `stats()` (HybridPrefixCache counts the rows it loads instead: record_request)."""
        if not is_int(longer_than):  # (before the host tier's match, which locks what it returns)
            raise InvalidInputError(f"longer_than={longer_than!r} must be an int: the device match's length")
        if self.offload is None:
            return None
        match = self.offload.match(tokens, namespace=namespace)
        if match.length > longer_than:
            if count:
                self._count_offload_hit()
            self._host_matches.add(id(match))
            return match
        self.offload.release(match)
        return None

    @serialized
    def lookup(self, tokens: Sequence[int], namespace: str = "default", count: bool = True) -> tuple:
        """(device match, match to load from: the host tier's when it reuses more, else the device one); both stay
        locked until `release_lookup`."""
        match = self.match(tokens, namespace)
        try:
            return match, self.match_offloaded(tokens, namespace, match.length, count) or match
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

    @serialized
    def explain(self, tokens: Sequence[int], match) -> str:
        """Why a live match (of either tier) of `tokens` reuses no more (a reason code, cache/explain.py)."""
        core = self.offload if id(match) in self._host_matches else self.core
        core._check_match(match)
        return why(core, as_tokens(tokens), match)

    def hold(self, cache) -> None:
        """Keep `cache` (anything with `commit()`) to admit on the store's next use."""
        if not callable(getattr(cache, "commit", None)):  # (flush would fail on it at every later use)
            raise InvalidInputError(f"store.hold takes a cache with a commit() method, got {type(cache).__name__}")
        with self.lock:
            self._open[id(cache)] = cache

    def drop(self, cache) -> None:
        with self.lock:
            self._open.pop(id(cache), None)

    @serialized
    def admit(self, tokens: Sequence[int], kv: Callable[[int, int], TensorKV], states: dict[int, TensorState],
              namespace: str = "default"):
        """Offer a sequence, its KV (by token range) and states at some positions to the admission policy.
        Returns the core's Admission (new tokens and states stored), falsy (with a warning: the request ran, its
        entry is not stored) when the budget cannot hold it. Tensors of other shapes, dtypes or devices than the
        model computes are refused (InvalidInputError; cache/entry_shapes.py)."""
        return self._admit(tokens, kv, states, namespace, computed=False)

    @serialized
    def _admit(self, tokens, kv, states, namespace: str, computed: bool):
        """`admit`; `computed`: the model computed these tensors (a HybridPrefixCache's commit): they set the shapes
        others are checked against."""
        if not callable(kv):
            raise InvalidInputError(f"kv must be a callable (start, end) -> TensorKV, got {kv!r}")
        tokens = as_tokens(tokens)  # (len() of what is no sequence: a raw TypeError)
        if len(tokens) > self.admit_limit:
            raise InvalidInputError(f"a {len(tokens)}-token entry: this model computes tokens past its first "
                                    f"{self.admit_limit} otherwise in forwards of other lengths (store.admit_limit); "
                                    "admit at most that many")
        states = as_states(states)
        devices = {} if computed else layer_devices(self.model, self.walk)
        checked = self.entry_shapes.reader(kv, states, self.layout, devices, self.device, computed)
        admitted = self.core.admit(tokens, kv=checked, namespace=namespace,
                                   states={position: owning_state(state) for position, state in states.items()})
        if not admitted:
            warnings.warn(
                f"PrefixStore: a {len(tokens)}-token entry does not fit in capacity={self.capacity_bytes} bytes "
                "(or everything else is in use); it was not stored (the request itself ran, reusing what it "
                "could). Raise the capacity to reuse it",
                RuntimeWarning,
                stacklevel=2,
            )
        return admitted

    @serialized
    def flush(self, lookup: bool = False) -> None:
        """Admit everything open caches hold now (their requests may go on; later tokens are admitted later); for a
        `lookup` (and stats(), a batch's priming), not the decode steps of generate() calls still running."""
        lookup = check_bool("lookup", lookup)
        decoding = {i: c for i, c in self._open.items() if lookup and getattr(c, "only_decoded_since_commit", bool)()}
        open_caches, self._open = [c for i, c in self._open.items() if i not in decoding], decoding
        for cache in open_caches:
            try:
                cache.commit()
            except InvalidInputError as error:  # that request's tensors do not fit the store: the others still go in
                cache.admit_nothing()
                warnings.warn(f"PrefixStore: a request was not admitted: {error}", RuntimeWarning, stacklevel=2)

    @serialized
    def stats(self) -> dict:
        """Core statistics (bytes, checkpoints, evictions, rejected admissions, alpha and its tuner's seconds and
        whether a tuning is running...) plus reuse per sequence served:
        sequences, hit_sequences, reused_tokens, reused_bytes (KV + state bytes loaded from the store), offload_hits
        (sequences whose reuse was loaded from the host tier),
        decoded_tokens_left_out (summed over rows: model_info.decode_differs_from_prefill), limited_tokens_left_out
        (past a media placeholder or `admit_limit`),
        `reasons` {reason: sequences} over every code of cache/explain.py's REASONS and `miss_reasons`, the same
        without "hit" (format either with `prefixlab.cache.explain.format_reasons`)."""
        self.flush(lookup=True)  # (a monitor polling while generate() decodes: its steps are admitted at its end)
        host = self.offload.stats() if self.offload else {}
        offload = {f"offload_{k}": v for k, v in host.items() if k.endswith("bytes")}
        return {**self.core.stats(), **offload, **self._counted()}

    # -- persistence (cache/persist.py) -----------------------------------------------------------------------------
    @serialized
    def save(self, path: str | Path) -> None:
        """Write every entry of both tiers (tokens, KV, checkpoints, per namespace) to a safetensors file, with the
        model identity, a fingerprint of its weights and a checksum per tensor. Shared prefixes are written once;
        the file is replaced atomically (a failed save leaves the previous file intact)."""
        save_store(self, path)

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module, **options) -> PrefixStore:
        """A store for `model` holding what `save` wrote: each tier loaded with its saved options rebuilt as saved,
        policy state included, serving on as the saved one would (cache/restore.py); otherwise re-admitted path by
        path (host-tier entries into the offload tier, or the device tier if `offload_capacity=None`). `options`
        override the saved capacity / offload_capacity / policy / block_size. The whole file is verified first:
        ModelMismatchError if it is for another config, dtype or weights, CorruptStoreError if it is damaged."""
        return load_store(cls, path, model, options)
