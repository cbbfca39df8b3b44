"""A model's default PrefixStore, the store `HybridPrefixCache()` (built without one) binds to, the checks of what a
cache is bound to, and of the options a store is built with.

The model holds weak references to its open stores (`model._prefixlab_open_stores`, in the order they were built;
a global registry would keep models alive): the default is the first of them still open, so its `close()`, or its
collection when the user dropped it, hands the role to the next. Only the store `default_for` creates for unbound
caches is held strongly (`model._prefixlab_default_store`: a cycle the GC collects with the model). One re-entrant
lock guards lookup-or-create, so threads binding unbound caches at once on one model share one default store.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from prefixlab.cache.model_info import STATE_DROPPING_MODEL_TYPES, model_identity, parse_capacity
from prefixlab.cache.sharing import check_open
from prefixlab.errors import (
    InvalidInputError,
    ModelMismatchError,
    UnsupportedModelError,
    check_bool,
    check_not_compiled_wrapper,
)

if TYPE_CHECKING:
    from prefixlab.cache.store import PrefixStore

_ATTR = "_prefixlab_default_store"
_OPEN = "_prefixlab_open_stores"  # weak references to the model's open stores, in the order they were built
_LOCK = threading.RLock()  # re-entrant: creating the default store registers it under the same lock


def default_store(model: torch.nn.Module) -> PrefixStore | None:
    """The model's default store (its first open PrefixStore not collected), or None."""
    with _LOCK:
        stores = (ref() for ref in model.__dict__.get(_OPEN, ()))
        return next((store for store in stores if store is not None and not store.closed), None)


def register(store: PrefixStore) -> None:
    """Count `store` among its model's open stores (the default if it is the first)."""
    with _LOCK:
        model = store.model.__dict__
        model[_OPEN] = [ref for ref in model.get(_OPEN, ()) if ref() is not None] + [weakref.ref(store)]


def unregister(store: PrefixStore) -> None:
    """`store` closes: the model's next open store (in the order they were built), if any, becomes its default."""
    with _LOCK:
        model = store.model.__dict__
        model[_OPEN] = [ref for ref in model.get(_OPEN, ()) if ref() is not None and ref() is not store]
        if model.get(_ATTR) is store:
            del model[_ATTR]


def default_for(cls: type[PrefixStore], model: torch.nn.Module, options: dict) -> PrefixStore:
    """`PrefixStore.default_for`: the model's default store, created with `options` if it has none (atomically);
    options given for an existing one must equal the ones it was built with."""
    check_model_argument(model, "PrefixStore")  # (before the model's attributes are read)
    with _LOCK:
        store = default_store(model)
        if store is None:
            store = model.__dict__[_ATTR] = cls(model, **options)  # (no user holds it: the model does)
            return store
    wanted = {name: normalize_option(name, value) for name, value in options.items()}
    differ = {name: value for name, value in wanted.items()
              if name not in store.options or store.options[name] != value}
    if differ:
        built = {name: store.options.get(name) for name in differ}
        raise InvalidInputError(
            f"this model's default store was built with {built}, the cache asks for {differ}. Leave those options "
            "out to share the default store, or give the cache a store of its own: "
            "HybridPrefixCache(PrefixStore(model, ...))"
        )
    return store


def cache_store_options(store: PrefixStore | None, options: dict) -> dict:
    """`HybridPrefixCache(store, **options)`'s store options, checked and normalized: options only without a store
    (they choose or create the default store), a given store must be open."""
    from prefixlab.cache.store import PrefixStore

    if store is not None:
        if options:
            raise InvalidInputError(f"{sorted(options)} are options of the store: pass them to PrefixStore, "
                                    "or leave the store out to use the model's default store")
        check_open(store)
        return {}  # (each request builds a cache: no signature to read)
    known = frozenset(inspect.signature(PrefixStore).parameters) - {"model", "core_options"}
    if unknown := sorted(set(options) - known):
        raise InvalidInputError(f"unknown HybridPrefixCache options {unknown}; store options are {sorted(known)}")
    return {name: normalize_option(name, value) for name, value in options.items()}


def check_bound_store(store: PrefixStore, model: torch.nn.Module) -> None:
    """A cache bound to `store` is used by `model`: it must be the store's model, and the store open."""
    if store.model is not model:
        identity = model_identity(model)
        why = ("config or dtype differ" if identity != store.identity
               else "an equal model, but another object: stores hold tensors of one model object")
        raise ModelMismatchError(
            f"a HybridPrefixCache built for another model ({store.identity[:12]}, {store.model.dtype}) was passed to "
            f"this one ({identity[:12]}, {model.dtype}); {why}. Use a HybridPrefixCache over this model's store, or "
            "one without a store"
        )
    check_unconverted(store, model)
    check_open(store)


def check_unconverted(store: PrefixStore, model: torch.nn.Module) -> None:
    """The store holds tensors in the dtype its model had when it was built: a model converted since (model.to(
    torch.bfloat16)) would run on them (a dtype error inside attention, or silently mixed precision)."""
    if model.dtype != store.dtype:
        raise ModelMismatchError(
            f"the model was converted to {model.dtype} after its PrefixStore was built: the store holds "
            f"{store.dtype} KV and states. Close that store (store.close()) and use a new one for the converted "
            "model, or convert the model back"
        )


def normalize_option(name: str, value):
    """A store option as `PrefixStore.options` holds it (capacities in bytes), validated."""
    if name == "capacity":
        return parse_capacity(value)
    if name == "offload_capacity":
        return None if value is None else parse_capacity(value, "offload_capacity")
    if name == "media_cache":  # (0, or "0MB": no encoded images kept)
        return parse_capacity(value, "media_cache", zero=True)
    if name == "patch":
        return check_bool("patch", value)
    if name == "policy":
        from prefixlab.cache.policies import check_policy_name

        check_policy_name(value)
    return value


def check_model_argument(model: object, call: str) -> None:
    """InvalidInputError unless `model` is a transformers model itself (not torch.compile's wrapper of one)."""
    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        raise InvalidInputError(f"model must be a transformers model, got {type(model).__name__}")
    check_not_compiled_wrapper(model, call)


def check_store_arguments(model: torch.nn.Module, patch: bool, core_options: dict) -> None:
    """Refuse what a PrefixStore cannot be built on: not a transformers model, a compiled wrapper, an option the core
    does not take, a family whose states are reused exactly only through prefixlab's kernels with patch=False."""
    from prefixlab.cache.core import PrefixCacheCore

    check_model_argument(model, "PrefixStore")
    normalize_option("patch", patch)
    keywords = sorted(name for name, parameter in inspect.signature(PrefixCacheCore).parameters.items()
                      if parameter.kind is parameter.KEYWORD_ONLY)
    if unknown := sorted(set(core_options) - set(keywords)):
        raise InvalidInputError(
            f"PrefixStore has no option {', '.join(unknown)}; it takes capacity, policy, offload_capacity, "
            f"block_size, patch, media_cache and {', '.join(keywords)}"
        )
    model_type = getattr(model.config, "model_type", "")
    if model_type in STATE_DROPPING_MODEL_TYPES and not (patch or getattr(model, "prefixlab_patched", False)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: {STATE_DROPPING_MODEL_TYPES[model_type]}; prefixes cannot be reused exactly "
            "unless its layers are patched: keep patch=True or call prefixlab.recurrent.patch(model) first"
        )
