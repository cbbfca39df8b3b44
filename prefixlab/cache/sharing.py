"""What lets one PrefixStore serve many threads and survive any exception.

- `serialized`: a store method runs under the store's re-entrant lock and refuses a closed store. The lock covers
  bookkeeping and tensor copies only (lookups, loads, plans, admissions, commits, evictions to the host tier,
  counters); model forwards run outside it, concurrently.
- `guard_forward(model)` / `unguard_forward(model)`: torch runs `always_call` forward hooks only for `Exception`, so a
  `KeyboardInterrupt` (or any other BaseException) raised inside a forward would leave a HybridPrefixCache half
  advanced. The guard wraps the model's forward in a try/except that resets every HybridPrefixCache the forward was
  given before re-raising. One guard per model, shared by every store on it (reference counted).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from prefixlab.errors import StoreClosedError

Method = TypeVar("Method", bound=Callable)
_GUARD = "_prefixlab_forward_guard"  # model attribute: [the guard, the forward attribute it replaced or None, users]
_GUARD_LOCK = threading.Lock()


def check_open(store) -> None:
    if store.closed:
        raise StoreClosedError(
            "this PrefixStore was closed (store.close() removed its hooks from the model); it serves no more "
            "requests. Build a new PrefixStore(model) and HybridPrefixCache objects over it"
        )


def serialized(method: Method) -> Method:
    """Run a PrefixStore method under `store.lock` after checking that the store is open."""

    @functools.wraps(method)
    def locked(store, *args, **kwargs):
        with store.lock:
            check_open(store)
            return method(store, *args, **kwargs)

    return locked  # type: ignore[return-value]


def under_store_lock(method: Method) -> Method:
    """Run a HybridPrefixCache method under its store's lock: another thread's commit then sees the cache's tensors
    and token record in step (before or after the method, never halfway)."""

    @functools.wraps(method)
    def locked(cache, *args, **kwargs):
        with cache.store.lock:
            return method(cache, *args, **kwargs)

    return locked  # type: ignore[return-value]


def guard_forward(model: torch.nn.Module) -> None:
    """Make any exception raised inside `model`'s forward reset the HybridPrefixCache it was given (counted: call
    `unguard_forward` once per call)."""
    with _GUARD_LOCK:
        entry = vars(model).get(_GUARD)
        if entry is not None:
            entry[2] += 1
            return
        replaced = vars(model).get("forward")
        inner = model.forward

        @functools.wraps(inner)  # transformers reads the forward's signature (via __wrapped__) to pick inputs
        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException:
                _reset_caches(args, kwargs)
                raise

        model.forward = forward
        vars(model)[_GUARD] = [forward, replaced, 1]


def unguard_forward(model: torch.nn.Module) -> None:
    """Undo one `guard_forward`; the last one restores the model's forward (unless something wrapped the guard since,
    e.g. torch.compile: the guard then stays, harmless)."""
    with _GUARD_LOCK:
        entry = vars(model).get(_GUARD)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        del vars(model)[_GUARD]
        guard, replaced = entry[0], entry[1]
        if vars(model).get("forward") is guard:
            if replaced is None:
                del model.forward
            else:
                model.forward = replaced


def _reset_caches(args: tuple, kwargs: dict) -> None:
    from prefixlab.cache.hf import HybridPrefixCache

    for value in (*args, *kwargs.values()):
        if isinstance(value, HybridPrefixCache):
            value.store.forward_failed(value)
