"""The forward hooks through which a model drives its prefix caches.

`generate()` never shows a cache the prompt before its first forward, so the model carries a forward pre-hook and an
always-called post-hook (one pair per model, shared by every store and cache on it). The hooks know only the
`ModelDrivenCache` protocol below:
- pre-hook, first forward of a cache: `prefixlab_bind(model)` (an unbound cache picks the model's default store, a
  bound one checks it belongs to this model), `begin(...)` -> columns already cached, the prefill split at
  `capture_splits(...)`, and the model runs on the rest;
- pre-hook, every forward: `record(input_ids)`; post-hook: `forward_done()` or, if the forward raised,
  `forward_failed()`.
Direction of the imports: hooks.py <- store.py (installs the hooks: `attach` / `detach`) <- hf.py (HybridPrefixCache
implements the protocol over a PrefixStore). The store never calls a cache except `commit()` on the ones it holds.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from prefixlab.errors import InvalidInputError


class ModelDrivenCache:
    """The protocol the hooks drive (HybridPrefixCache implements it)."""

    started: bool

    def prefixlab_bind(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None) -> int:
        raise NotImplementedError

    def capture_splits(self, start: int, stop: int) -> list[int]:
        raise NotImplementedError

    def record(self, input_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def forward_done(self) -> None:
        raise NotImplementedError

    def forward_failed(self) -> None:
        raise NotImplementedError


class _ModelHooks:
    """The hook pair of one model and who needs it (stores, `prefixlab.patch`); holds no reference to the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cache_arg = "cache_params" if "cache_params" in forward_parameters(model) else "past_key_values"
        self.owners: set[int] = set()
        self.handles = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
        ]

    def _cache(self, kwargs: dict) -> ModelDrivenCache | None:
        cache = kwargs.get(self.cache_arg, kwargs.get("past_key_values"))
        return cache if isinstance(cache, ModelDrivenCache) else None

    def before_forward(self, module, args: tuple, kwargs: dict):
        cache = self._cache(kwargs)
        if cache is None:
            return None
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise InvalidInputError("with HybridPrefixCache, pass model inputs by keyword (input_ids=...)")
            kwargs = {"input_ids": args[0], **kwargs}
        if self.cache_arg != "past_key_values" and kwargs.get("past_key_values") is cache:
            kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"} | {self.cache_arg: cache}
        if kwargs.get("input_ids") is None:
            raise InvalidInputError(
                "HybridPrefixCache needs input_ids: inputs_embeds cannot be matched against cached tokens"
            )
        cache.prefixlab_bind(module)  # after the input checks: refused input creates no default store
        if not cache.started:
            kwargs = _start(module, cache, kwargs)
        cache.record(kwargs["input_ids"])
        return (), kwargs

    def after_forward(self, module, args: tuple, kwargs: dict, output) -> None:
        cache = self._cache(kwargs)
        if cache is None or not cache.started:
            return
        if output is None:  # the forward raised
            cache.forward_failed()
        else:
            cache.forward_done()


_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelHooks


def attach(model: torch.nn.Module, owner: object) -> None:
    """Make sure `model` carries the hooks; `owner` (a store, or the model itself for `prefixlab.patch`) keeps
    them there until it calls `detach`."""
    hooks = _HOOKS.get(model)
    if hooks is None:
        hooks = _HOOKS[model] = _ModelHooks(model)
    hooks.owners.add(id(owner))


def detach(model: torch.nn.Module, owner: object) -> None:
    """`owner` no longer needs the hooks; the last one out removes them."""
    hooks = _HOOKS.get(model)
    if hooks is None:
        return
    hooks.owners.discard(id(owner))
    if not hooks.owners:
        for handle in hooks.handles:
            handle.remove()
        del _HOOKS[model]


def is_attached(model: torch.nn.Module, owner: object | None = None) -> bool:
    """Whether `model` carries the hooks (for `owner`, when given)."""
    hooks = _HOOKS.get(model)
    return hooks is not None and (owner is None or id(owner) in hooks.owners)


def _start(module, cache: ModelDrivenCache, kwargs: dict) -> dict:
    """Begin the request, run the prefill up to each planned capture split, return the last segment's kwargs."""
    length = kwargs["input_ids"].shape[1]
    start = cache.begin(kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"))
    for stop in cache.capture_splits(start, length):
        segment = _slice_inputs(kwargs, start, stop, length)
        if "logits_to_keep" in forward_parameters(module):
            segment["logits_to_keep"] = 1  # only the states matter here
        module(**segment)
        start = stop
    return _slice_inputs(kwargs, start, length, length)


def forward_parameters(module: torch.nn.Module) -> frozenset[str]:
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
