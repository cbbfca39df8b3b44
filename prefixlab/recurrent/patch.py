"""`patch(model)`: route a Hugging Face hybrid model's linear-attention layers through prefixlab kernels.

Each supported layer (see families/) gets a forward that continues from the conv + recurrent state the Cache holds
for any number of new tokens (transformers 5.23 does so too, except its Mamba1 layers, which restart multi-token
scans from zeros), records states at the offsets the cache asks for (`prefixlab_capture_positions` /
`prefixlab_record`, defined in families/base.py) and writes its final states to the Cache exactly as transformers
does. Outputs equal the unpatched model's (fp32 within 1e-5).

`patch` is idempotent (patching again only changes the backend) and reversible: `unpatch(model)` restores every
layer's own forward, and `patched(model)` does both around a `with` block. Patching swaps the forward of each layer
*instance* (the class is untouched, so other models are unaffected); under accelerate's hooks the hooked inner
forward is swapped so device placement keeps working.

Owners (PrefixStores) share one patch through `hold` / `let_go`: the first hold patches, the last let-go unpatches,
so closing one of two stores on a model leaves the other's model patched. A patch applied by hand (`patch(model)`)
is never undone by them.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.integrations.accelerate import force_accelerate_hooks

from prefixlab.errors import InvalidInputError, UnsupportedModelError, check_not_compiled_wrapper
from prefixlab.recurrent.dispatch import PORTABLE_BACKENDS
from prefixlab.recurrent.families import SUPPORTED_CLASSES, Family, family_of, recorder_of
from prefixlab.recurrent.families.base import ORIGINAL_ATTRIBUTE, run_layer

BACKENDS = ("auto", *PORTABLE_BACKENDS)
_ORIGINAL = ORIGINAL_ATTRIBUTE  # (attribute swapped, its instance value before patching or None)
_OWNERS = "_prefixlab_patch_owners"  # how many owners hold a patch that `hold` applied
_OWNERS_LOCK = threading.Lock()
_BACKEND = "_prefixlab_patch_backend"  # the backend `patch` last ran with


def patch(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Patch every linear-attention layer of `model` in place and return the model.

    backend: kernel backend for the scans: "auto" (fla / mamba_ssm for CUDA tensors where they take the inputs,
    else chunked torch), "naive", "torch" or "compiled". One-token forwards take the token loop, except that "auto"
    keeps fla (its fused recurrent kernel) and mamba_ssm where they apply (see families/base.py).

    Raises UnsupportedModelError naming the class of any linear-attention layer no family serves (nothing is
    patched then). A model without linear-attention layers is returned unchanged."""
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    check_not_compiled_wrapper(model, "prefixlab.recurrent.patch")
    targets = linear_attention_layers(model)
    for layer, family in targets:
        _swap(layer, "forward", _PatchedForward(layer, backend, family))
    for layer in model.modules():  # (only where linear-attention layers are: their cache layers hold the states)
        if targets and (recorder := recorder_of(layer)) is not None:
            _swap(layer, recorder.attribute, _Recording(layer))
    if targets:
        model.prefixlab_patched = True  # what PrefixStore checks to let the layers record states mid-forward
        vars(model)[_BACKEND] = backend  # (for layers put in later: patch_new_layers)
    return model


def patch_new_layers(model: nn.Module) -> int:
    """In a patched model, patch the linear-attention layers (and state recorders) that run their own forward:
    modules put into the model after it was patched (a layer replaced), with the backend its patched layers run.
    Returns how many. (Such a layer records no states mid-forward, so a store could admit none of its requests: a
    store calls this whenever the model's module tree changed.)"""
    if not vars(model).get("prefixlab_patched"):
        return 0
    targets = linear_attention_layers(model)
    fresh = [(layer, family) for layer, family in targets if _ORIGINAL not in vars(layer)]
    for layer, family in fresh:
        _swap(layer, "forward", _PatchedForward(layer, vars(model).get(_BACKEND, "auto"), family))
    recorders = [layer for layer in model.modules() if _ORIGINAL not in vars(layer) and recorder_of(layer) is not None]
    for layer in recorders if targets else ():
        _swap(layer, recorder_of(layer).attribute, _Recording(layer))
    return len(fresh) + (len(recorders) if targets else 0)


def _swap(layer: nn.Module, attribute: str, patched: Any) -> None:
    """Set `layer.<attribute>` to `patched`, remembering the original once (accelerate's hooks wrap a forward
    around `_old_forward`: that one is swapped)."""
    if attribute == "forward" and hasattr(layer, "_hf_hook") and "_old_forward" in vars(layer):
        attribute = "_old_forward"
    if _ORIGINAL not in vars(layer):
        setattr(layer, _ORIGINAL, (attribute, vars(layer).get(attribute)))
    setattr(layer, vars(layer)[_ORIGINAL][0], patched)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the original forward of every layer `patch` changed; a no-op on an unpatched model."""
    for layer in model.modules():
        saved = vars(layer).pop(_ORIGINAL, None)
        if saved is None:
            continue
        attribute, original = saved
        if original is None:
            delattr(layer, attribute)
        else:
            setattr(layer, attribute, original)
    vars(model).pop("prefixlab_patched", None)
    vars(model).pop(_OWNERS, None)
    vars(model).pop(_BACKEND, None)
    return model


def hold(model: nn.Module, apply: bool = True) -> bool:
    """Take a share of the patch an owner needs: join a patch other owners hold, or (`apply`) patch an unpatched
    model. Returns whether this call took a share (then call `let_go` once); False when the model has nothing to
    patch, was patched by hand (its patch is not ours to undo), or stays unpatched (`apply=False`)."""
    with _OWNERS_LOCK:
        owners = vars(model).get(_OWNERS)
        if owners is None:
            if not apply or is_patched(model):
                return False
            patch(model)
            if not is_patched(model):
                return False
            owners = 0
        vars(model)[_OWNERS] = owners + 1
        return True


def let_go(model: nn.Module) -> None:
    """Give back a share taken by `hold`; the last one unpatches the model."""
    with _OWNERS_LOCK:
        owners = vars(model).get(_OWNERS)
        if owners is None:  # unpatched by hand meanwhile
            return
        if owners > 1:
            vars(model)[_OWNERS] = owners - 1
        else:
            unpatch(model)


@contextmanager
def patched(model: nn.Module, backend: str = "auto") -> Iterator[nn.Module]:
    """`with patched(model): ...` runs the block with the model patched and restores it after, even on error.
    A model that was already patched stays patched."""
    was_patched = is_patched(model)
    patch(model, backend)
    try:
        yield model
    finally:
        if not was_patched:
            unpatch(model)


def is_patched(model: nn.Module) -> bool:
    """Whether any layer of `model` currently runs prefixlab's forward."""
    return any(_ORIGINAL in vars(layer) for layer in model.modules())


def linear_attention_layers(model: nn.Module) -> list[tuple[nn.Module, Family]]:
    """(layer, family) for every linear-attention layer; UnsupportedModelError if one has no family.

    A linear-attention layer is recognised by what all of them hold: a depthwise (groups == channels) Conv1d child
    and a `layer_idx` (the cache slot it reads and writes)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    for layer in model.modules():
        if not looks_linear_attention(layer):
            continue
        family = family_of(layer)
        if family is None:
            cls = type(layer)
            # fla registers its models under transformers' "mamba" / "mamba2" types once imported (transformers
            # imports it for GatedDeltaNet layers): AutoModel then builds fla's model, not transformers'
            hint = (" (an fla model: build transformers' own class by name, e.g. transformers.Mamba2ForCausalLM, not "
                    "through AutoModel, which fla's import re-registers)" if cls.__module__.startswith("fla.") else "")
            raise UnsupportedModelError(
                f"{cls.__module__}.{cls.__qualname__} is a linear-attention layer prefixlab cannot patch{hint}; "
                f"supported layer classes (transformers' own): {', '.join(SUPPORTED_CLASSES)}"
            )
        found.append((layer, family))
    return found


def looks_linear_attention(layer: nn.Module) -> bool:
    if family_of(layer) is not None:
        return True
    if recorder_of(layer) is not None:  # (a depthwise conv, but not a mixer: Qwen4-Exp's PLE)
        return False
    depthwise = any(
        isinstance(child, nn.Conv1d) and child.groups == child.in_channels > 1 for child in layer.children()
    )
    return depthwise and hasattr(layer, "layer_idx")


class _PatchedForward:
    """A patched layer's forward: prefixlab's kernels on `layer`. An object, not a closure, so that a copy of the
    model (`copy.deepcopy`: TRL's reference models) runs its own layers, not the original's, and a patched model
    pickles (`torch.save(model)`): both rebuild it around the copied layer."""

    def __init__(self, layer: nn.Module, backend: str, family: Family | None = None):
        self.layer, self.backend, self._family, self._run = layer, backend, family, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seq_lens_q") is not None:
            raise InvalidInputError(
                "packed sequences (cu_seq_lens_q) are not supported by prefixlab's patched layers: pass a padded "
                "batch, or unpatch(model) first"
            )
        if self._run is None:  # (after a copy or an unpickling: the layer is whole by its first call)
            self._family = self._family or family_of(self.layer)
            self._run = getattr(self._family, "run", None) or force_accelerate_hooks(
                list(self._family.read_directly))(run_layer)
        if hasattr(self._family, "run"):  # a layer of its own shape: it takes the layer's own arguments
            return self._run(self.layer, *args, **kwargs)
        return self._mixer(*args, **kwargs)

    def _mixer(self, hidden_states: torch.Tensor, cache_params: Any = None,
               attention_mask: torch.Tensor | None = None,
               past_key_values: Any = None,  # LFM2 passes its cache under this name
               **kwargs: Any) -> torch.Tensor:
        cache = cache_params if cache_params is not None else past_key_values
        return self._run(self.layer, self._family, hidden_states, cache, attention_mask, self.backend)

    def __deepcopy__(self, memo: dict) -> _PatchedForward:
        return _PatchedForward(copy.deepcopy(self.layer, memo), self.backend)

    def __reduce__(self):
        return _PatchedForward, (self.layer, self.backend)


class _Recording:
    """A recorder's layer method (families/ple.py): hands the cache the states at the capture offsets, then runs
    the layer's own method unchanged. An object for the same reasons as _PatchedForward."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, inputs: torch.Tensor, cache: Any, *args: Any, **kwargs: Any) -> Any:
        if cache is not None:
            recorder_of(self.layer).record(self.layer, inputs, cache)
        attribute, saved = vars(self.layer)[_ORIGINAL]
        original = saved if saved is not None else getattr(type(self.layer), attribute).__get__(self.layer)
        return original(inputs, cache, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Recording:
        return _Recording(copy.deepcopy(self.layer, memo))

    def __reduce__(self):
        return _Recording, (self.layer,)
