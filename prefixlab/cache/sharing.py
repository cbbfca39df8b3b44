"""What lets one PrefixStore serve many threads: its lock and the closed-store check.

- `serialized`: a store method runs under the store's re-entrant lock and refuses a closed store. The lock covers
  bookkeeping and tensor copies only (lookups, loads, plans, admissions, commits, evictions to the host tier,
  counters); model forwards run outside it, concurrently.
- `under_store_lock`: the same lock around a HybridPrefixCache method (its state transitions and beam reorders), so
  another thread's commit sees the cache before or after the method, never halfway.
The forward guard that resets a cache on any exception (KeyboardInterrupt included) lives with the hooks
(cache/hooks.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from prefixlab.errors import StoreClosedError

Method = TypeVar("Method", bound=Callable)


def check_open(store) -> None:
    """StoreClosedError if `store` was closed."""
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
    """Run a HybridPrefixCache method under its store's lock (directly when the cache is not bound to a store yet:
    nothing else can see it then)."""

    @functools.wraps(method)
    def locked(cache, *args, **kwargs):
        if cache.store is None:
            return method(cache, *args, **kwargs)
        with cache.store.lock:
            return method(cache, *args, **kwargs)

    return locked  # type: ignore[return-value]
