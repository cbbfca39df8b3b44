"""What a PrefixStore takes from its model and gives back: its share of the kernel patch and of the forward hooks,
given back by close() or, for a store collected without it, by the garbage collector (weakref.finalize)."""

from __future__ import annotations

import weakref

import torch

from prefixlab.cache.hooks import COLLECTED, detach
from prefixlab.errors import UnsupportedModelError


def hold_patch(model: torch.nn.Module, apply: bool) -> bool:
    """Route the model's linear-attention layers through prefixlab kernels, which resume any forward from the cached
    states and record planned states inside the one prefill pass (exact: tests/test_recurrent_patch*.py); shared with
    the other owners on the model (recurrent/patch.py `hold`). Returns whether the caller holds a share (then it
    calls `recurrent.patch.let_go` once)."""
    from prefixlab.recurrent.patch import hold

    try:
        return hold(model, apply)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(
            f"{err}. Build the store with patch=False to keep transformers' own layers (planned states are then "
            "captured by splitting the prefill at them)"
        ) from err



def patch_replaced_layers(model: torch.nn.Module, kept) -> None:
    """Patch the linear-attention layers put into a patched model since (a module replaced under a store: it runs its
    own forward, which records no state), once per module tree of the store's KeptWalk `kept` (at every call for a
    model with accelerate hooks, which is walked at every call)."""
    from prefixlab.recurrent.patch import patch_new_layers

    if kept.walk is None:
        patch_new_layers(model)
    else:
        kept.walk.derived("new layers patched", lambda: patch_new_layers(model))

# What collected stores have to give back. The garbage collector runs a finalizer wherever the collected thread was,
# possibly inside attach/detach or the patch's hold/let_go with their (non re-entrant) locks held: a finalizer that
# took them deadlocked. So it only queues; the queue is drained at the next safe point (release_collected).
_COLLECTED = COLLECTED  # (kept in hooks.py: a plain forward of the model drains it too)


def release_when_collected(store: object, model: torch.nn.Module, holds_patch: bool) -> weakref.finalize:
    """A callable queueing `store`'s hooks (and patch share, if it `holds_patch`) on `model` to be given back, once:
    when called (close, which then drains the queue) or when `store` is collected without it. It holds neither the
    store nor the model."""
    release = weakref.finalize(store, _COLLECTED.append, (weakref.ref(model), id(store), holds_patch))
    release.atexit = False  # (at interpreter exit there is nothing to give back to)
    return release


def release_collected() -> None:
    """Give back what the queued stores held (called where no prefixlab lock is held: building and closing stores,
    prefixlab.patch / unpatch, a forward of a hooked model without a prefixlab cache)."""
    while _COLLECTED:
        try:
            model_ref, store_id, holds_patch = _COLLECTED.popleft()
        except IndexError:  # (another thread drained it)
            return
        model = model_ref()
        if model is not None:
            detach(model, None, store_id)
            if holds_patch:
                from prefixlab.recurrent.patch import let_go

                let_go(model)
