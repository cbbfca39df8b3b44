"""`prefixlab.patch(model)`: the one line that lets `HybridPrefixCache(policy="dp")` run on a model without a store.

transformers never shows a cache the prompt before the model's first forward, so the model itself must carry the
hooks that bind a cache to a store and cut the prompt to what is not cached; this puts them there once.
"""

from __future__ import annotations

import threading
import weakref

import torch

from prefixlab.cache.defaults import default_store
from prefixlab.cache.hooks import attach, detach
from prefixlab.cache.model_info import CacheLayout
from prefixlab.errors import InvalidInputError, check_bool, check_not_compiled_wrapper

_HOLDS_KERNELS: weakref.WeakSet = weakref.WeakSet()  # models whose kernel patch `patch` holds a share of
_LOCK = threading.Lock()  # patch / unpatch of one model from several threads: one share at most


def patch(model: torch.nn.Module, kernels: bool = True) -> torch.nn.Module:
    """Prepare `model` for prefixlab (idempotent; returns it): put the forward hooks on it through which every
    `HybridPrefixCache` works, and with `kernels` route its linear-attention layers through prefixlab's kernels
    (`prefixlab.recurrent.patch`: exact, states captured inside the one prefill pass; a patch shared with the
    model's stores, so closing one of them leaves it on). Then
    `model.generate(..., past_key_values=HybridPrefixCache(policy="dp"))` binds each cache to the model's default
    store, created by the first one with its options. `prefixlab.unpatch(model)` undoes it."""
    _check_model(model, "patch")
    check_bool("kernels", kernels)
    CacheLayout.from_config(model.config)  # UnsupportedModelError now rather than on the first request
    from prefixlab.cache.ownership import release_collected

    release_collected()  # (stores collected without close(): their shares first)
    with _LOCK:
        if kernels and model not in _HOLDS_KERNELS:
            from prefixlab.cache.ownership import hold_patch

            if hold_patch(model, True):
                _HOLDS_KERNELS.add(model)
        attach(model, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: admit and close the model's default store, take the hooks off (unless other stores still
    use them) and give back the kernel patch `patch` took (restored once no store holds it either)."""
    _check_model(model, "unpatch")
    store = default_store(model)
    if store is not None:
        store.close()
    from prefixlab.cache.ownership import release_collected

    release_collected()
    with _LOCK:
        detach(model, model)
        if model in _HOLDS_KERNELS:
            from prefixlab.recurrent.patch import let_go

            let_go(model)
            _HOLDS_KERNELS.discard(model)
    return model


def _check_model(model: object, call: str) -> None:
    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        raise InvalidInputError(f"prefixlab.{call}(model) needs a transformers model, got {type(model).__name__}")
    check_not_compiled_wrapper(model, f"prefixlab.{call}")
