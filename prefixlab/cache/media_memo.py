"""Encoded images kept by their pixels: a later request with the same image skips the vision tower.

Once the store reuses an image's KV (multimodal.py keys its placeholders by content), encoding the image again is
most of what such a request still computes. Models whose images the hooks key (`MediaTokens.keyed_ids`) get their
`get_image_features` / `get_video_features` wrapped (for generate() and for direct forwards alike) by a memo keyed by
a digest of the pixels, the grid, the dtype, shape and device, and the model's weights version; the encoder's output
for the same key is the same computation on the same inputs. Least recently used outputs go past `capacity_bytes`
(per model: the largest any open store on it asks for, `PrefixStore(media_cache=...)`); calls with other options
(attentions, hidden states), with autograd on (a training step: its vision tower needs its own graph), under
torch.autocast (another precision than the weights'; the matmul precision settings are part of the key) or in
training mode (dropout draws a sample per call) are not memoized, and a request's namespace is part of the key (one
tenant never skips the vision tower on another's image). Each call gets its own copy of the output object
(generate() rewrites its fields when it expands a batch), sharing the tensors. The digest reads every pixel byte on
the CPU (BLAKE2b, about 0.7 ms a MB on the development machine: 13 ms for a 4096-patch image): where the vision
tower is cheaper than that, `media_cache=0` turns the memo off.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from prefixlab.cache.model_info import numeric_context
from prefixlab.cache.weights import weights_version

MEDIA_CACHE_BYTES = 256 * 2**20  # the default PrefixStore(media_cache=...)

# the namespace of the request this thread's model forward serves (set by the hooks): one namespace never gets
# another's encoder outputs, whose skipped vision tower would tell it that image was sent (the timing side channel
# namespaces close for prefixes)
_serving = threading.local()


def serve_namespace(namespace: str | None) -> None:
    """Key this thread's next encoder calls by `namespace` (None: a forward without a prefix cache)."""
    _serving.namespace = namespace


class FeatureMemo:
    """An LRU memo of encoder outputs under a byte budget (thread-safe)."""

    def __init__(self, capacity_bytes: int = MEDIA_CACHE_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.used_bytes = self.hits = self.misses = 0
        self.lock = threading.Lock()

    def wrap(self, encode: Callable, modality: str, weights: Callable[[], tuple],
             training: Callable[[], bool] = lambda: False) -> Callable:
        """`encode` (a model's `get_<modality>_features`) answered from the memo when it holds the call."""
        signature = inspect.signature(encode)
        var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        @functools.wraps(encode)
        def memoized(*args, **kwargs):
            # autograd on (a training step needs its own graph) or training mode (dropout: each call its own sample)
            memoizable = not torch.is_grad_enabled() and not training()
            key = self._key(signature, var_keyword, args, kwargs) if memoizable else None
            if key is None:
                return encode(*args, **kwargs)
            key = (modality, key, hash(weights()), getattr(_serving, "namespace", None))
            with self.lock:
                found = self.entries.get(key)
                if found is not None:
                    self.entries.move_to_end(key)
                    self.hits += 1
                    return copy.copy(found[0])
                self.misses += 1
            output = encode(*args, **kwargs)
            self._keep(key, output)
            return copy.copy(output)

        memoized.prefixlab_memoized = encode
        return memoized

    def _key(self, signature: inspect.Signature, var_keyword: str | None, args: tuple, kwargs: dict) -> bytes | None:
        """A digest of the call's arguments (tensors by dtype, shape, device and bytes) and of the matmul precision
        settings; None: not memoized (options other than return_dict, arguments that are not tensors or plain values,
        torch.autocast on for their device, or no budget)."""
        try:
            arguments = dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:
            return None
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        if self.capacity_bytes <= 0 or set(extra) - {"return_dict"}:
            return None
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(numeric_context()).encode())  # (TF32 / bf16 matmul passes change the output too)
        for name, value in sorted({**arguments, **extra}.items()):
            if isinstance(value, torch.Tensor):
                if torch.is_autocast_enabled(value.device.type):  # computed in another precision than the weights'
                    return None
                digest.update(str((name, value.dtype, tuple(value.shape), str(value.device))).encode())
                digest.update(memoryview(value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
            elif value is None or isinstance(value, bool | int | float | str):
                digest.update(repr((name, value)).encode())
            else:
                return None
        return digest.digest()

    def _keep(self, key: tuple, output: object) -> None:
        size = _nbytes(output)
        with self.lock:
            if size > self.capacity_bytes or key in self.entries:
                return
            self.entries[key] = (output, size)
            self.used_bytes += size
            while self.used_bytes > self.capacity_bytes:
                _, (_, freed) = self.entries.popitem(last=False)
                self.used_bytes -= freed

    def resize(self, capacity_bytes: int) -> None:
        with self.lock:
            self.capacity_bytes = capacity_bytes
            while self.used_bytes > max(capacity_bytes, 0) and self.entries:
                _, (_, freed) = self.entries.popitem(last=False)
                self.used_bytes -= freed


# transformers' generate() runs a VLM's encoders before its first forward (so before the hooks see the cache)
PREPARE = "_prepare_multimodal_encoder_kwargs_for_generation"


def install(module: torch.nn.Module, memo: FeatureMemo, model: torch.nn.Module | None = None) -> None:
    """Wrap `module`'s image and video encoders (instance attributes over its methods) with `memo`; and `model`'s
    generate() step that runs them, so that they are keyed by the namespace of the cache generate() was given."""
    weights = functools.partial(weights_version, module)
    for modality in ("image", "video"):
        name = f"get_{modality}_features"
        encode = getattr(module, name, None)
        if encode is not None and not hasattr(encode, "prefixlab_memoized"):
            setattr(module, name, memo.wrap(encode, modality, weights, lambda: module.training))
    prepare = getattr(model, PREPARE, None)
    if prepare is not None and not hasattr(prepare, "prefixlab_memoized"):
        @functools.wraps(prepare)
        def keyed_by_request(model_kwargs: dict, *args, **kwargs):
            serve_namespace(getattr(model_kwargs.get("past_key_values"), "namespace", None))
            return prepare(model_kwargs, *args, **kwargs)

        keyed_by_request.prefixlab_memoized = prepare
        setattr(model, PREPARE, keyed_by_request)


def uninstall(module: torch.nn.Module, model: torch.nn.Module | None = None) -> None:
    for owner, name in ((module, "get_image_features"), (module, "get_video_features"), (model, PREPARE)):
        if owner is not None and hasattr(vars(owner).get(name), "prefixlab_memoized"):
            delattr(owner, name)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0
