"""The wrappers the hooks (hooks.py) put on a model's methods, as instance attributes: the forward guard, and the
check a later `generate()` call over a used cache needs before it runs, which the forward hooks cannot make.

`generate` slices its input by the cache's length (`get_seq_length`) before the first forward: the hooks see only
the tokens past what the cache holds, at the positions that continue it, whether the input started with the held
tokens (a continued request) or not (a new prompt longer than the old one, which would run its tail on the old
request's KV and states). The hooks wrap the model's `generate` with `checked_generate`, which compares the input's
first columns with the tokens the cache holds before anything runs.
"""

from __future__ import annotations

import functools
import weakref

import torch

from prefixlab.cache.multimodal import KEY_BASE
from prefixlab.errors import InvalidInputError


def checked_generate(generate, cache_type: type):
    """`generate` refusing an input that a started cache of `cache_type` passed as past_key_values does not hold the
    start of (the cache is reset: what it held is admitted, and it serves the next call as a new request)."""

    @functools.wraps(generate)  # transformers and users read the signature (via __wrapped__)
    def checked(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, cache_type) and cache.started and not cache.in_flight:
            input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            check_continues(cache, input_ids, kwargs.get("attention_mask"))
        return generate(*args, **kwargs)

    return checked


def check_continues(cache, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """InvalidInputError (after resetting `cache`) if generate would take `input_ids` [batch, n] for the tokens the
    cache holds followed by new ones (n longer than what it holds, a mask, if any, as long as the input: generate's
    rule for slicing) and its first columns are not those tokens. Multimodal content keys stand for any placeholder."""
    seen = cache.get_seq_length()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] <= seen:
        return  # (no longer input: its positions are checked by the hooks)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != input_ids.shape[1]:
        return  # only the new tokens were passed (the mask spans the held ones too): generate does not slice
    held = cache.held_tokens()
    if held.shape == (input_ids.shape[0], seen):
        same = (input_ids[:, :seen].cpu() == held) | (held >= KEY_BASE)
        if bool(same.all()):
            return
    cache.reset()
    raise InvalidInputError(
        f"this HybridPrefixCache holds {seen} tokens of a request and the input passed to generate() does not start "
        f"with them: generate would run only its tokens past {seen}, on the old request's states; use a new "
        "HybridPrefixCache(store) per request. This cache is reset now (the request it held was admitted)"
    )


def shadow(model: torch.nn.Module, name: str, wrapper) -> weakref.ref:
    """Put `wrapper` on `model` as the instance attribute `name`, remembering the one it shadows for `unshadow`."""
    wrapper.prefixlab_replaced = vars(model).get(name)
    setattr(model, name, wrapper)
    return weakref.ref(wrapper)


def unshadow(model: torch.nn.Module, name: str, wrapper: weakref.ref | None) -> None:
    """Undo `shadow`, unless something wrapped the attribute since (torch.compile): then it stays."""
    current = vars(model).get(name)
    if wrapper is not None and current is not None and current is wrapper():
        if current.prefixlab_replaced is None:
            delattr(model, name)
        else:
            setattr(model, name, current.prefixlab_replaced)


def guarded(forward, cache_type: type):
    """`forward` resetting the started caches of `cache_type` it is given on any exception, KeyboardInterrupt
    included (torch skips the always-called post-hook for BaseExceptions)."""

    @functools.wraps(forward)  # transformers reads the forward's signature (via __wrapped__) to pick inputs
    def guard(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except BaseException:
            for value in (*args, *kwargs.values()):
                if isinstance(value, cache_type) and value.started:
                    value.forward_failed()
            raise

    return guard
