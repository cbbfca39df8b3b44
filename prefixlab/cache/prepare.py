"""`prefixlab.patch(model)`: the one line that lets `HybridPrefixCache(policy="dp")` run on a model without a store.

transformers never shows a cache the prompt before the model's first forward, so the model itself must carry the
hooks that bind a cache to a store and cut the prompt to what is not cached; this puts them there once.
"""

from __future__ import annotations

import weakref

import torch

from prefixlab.cache.hooks import attach, detach
from prefixlab.cache.model_info import CacheLayout
from prefixlab.errors import InvalidInputError

_KERNELS_PATCHED_HERE: weakref.WeakSet = weakref.WeakSet()


def patch(model: torch.nn.Module, kernels: bool = True) -> torch.nn.Module:
    """Prepare `model` for prefixlab (idempotent; returns it): put the forward hooks on it through which every
    `HybridPrefixCache` works, and with `kernels` route its linear-attention layers through prefixlab's kernels
    (`prefixlab.recurrent.patch`: exact, states captured inside the one prefill pass). Then
    `model.generate(..., past_key_values=HybridPrefixCache(policy="dp"))` binds each cache to the model's default
    store, created by the first one with its options. `prefixlab.unpatch(model)` undoes it."""
    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        raise InvalidInputError(f"prefixlab.patch(model) needs a transformers model, got {type(model).__name__}")
    CacheLayout.from_config(model.config)  # UnsupportedModelError now rather than on the first request
    if kernels and not getattr(model, "prefixlab_patched", False):
        from prefixlab.cache.store import _patch

        if _patch(model):
            _KERNELS_PATCHED_HERE.add(model)
    attach(model, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: admit and close the model's default store, take the hooks off (unless other stores still
    use them) and restore the layers `patch` routed through prefixlab's kernels."""
    from prefixlab.cache.store import default_store

    store = default_store(model)
    if store is not None:
        store.close()
    detach(model, model)
    if model in _KERNELS_PATCHED_HERE:
        from prefixlab.recurrent.patch import unpatch as unpatch_kernels

        unpatch_kernels(model)
        _KERNELS_PATCHED_HERE.discard(model)
    return model
