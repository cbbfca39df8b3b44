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
import threading
import weakref

import torch

from prefixlab.cache.multimodal import KEY_BASE, placeholder_token_ids
from prefixlab.errors import InvalidInputError


def checked_generate(generate, cache_type: type):
    """`generate` refusing an input that a started cache of `cache_type` cannot continue (the cache is reset: what it
    held is admitted, and it serves the next call as a new request)."""

    @functools.wraps(generate)  # transformers and users read the signature (via __wrapped__)
    def checked(*args, **kwargs):
        cache, cut = kwargs.get("past_key_values"), True  # generate cuts only a past_key_values input by its length
        if cache is None:
            cache, cut = kwargs.get("cache_params"), False  # (Mamba2: its whole input continues the cache)
        if not isinstance(cache, cache_type):
            return generate(*args, **kwargs)
        with _IN_USE_LOCK:  # one generate call per cache at a time: another's reset would cut this one's request
            owner, me = _IN_USE.get(cache), threading.get_ident()
            if owner not in (None, me):
                raise InvalidInputError(
                    "this HybridPrefixCache is in use by a generate() call in another thread; give each request "
                    "its own HybridPrefixCache(store) (the store is shared safely)")
            _IN_USE[cache] = me
        try:
            return _checked_call(generate, cache, cut, args, kwargs)
        finally:
            if owner is None:  # (the outermost call of this thread)
                with _IN_USE_LOCK:
                    _IN_USE.pop(cache, None)

    return checked


_IN_USE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> the thread running generate over it
_IN_USE_LOCK = threading.Lock()


def _checked_call(generate, cache, cut: bool, args: tuple, kwargs: dict):
    if cache.started and not cache.in_flight:
        input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        check_continues(cache, input_ids, kwargs.get("attention_mask"), cut)
        cache.commit()  # the request so far is stored now: a refusal or failure of this call loses none of it
    held_before = cache.get_seq_length() if cache.started else None
    # the columns of this call's input: lookups of other requests meanwhile leave only its decode steps (store.flush)
    prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    outer = getattr(cache, "generate_prompt", None)
    if hasattr(cache, "generate_prompt"):
        cache.generate_prompt = prompt.shape[-1] if isinstance(prompt, torch.Tensor) else None
    try:
        return generate(*args, **kwargs)
    except BaseException:
        # Raised between forwards (a logits processor, a stopping criterion, a streamer, Ctrl-C there): the forward
        # guard did not see it. What this call ran is forgotten, as for a failed forward; a cache this call did not
        # advance (generate refused its arguments) keeps its earlier request.
        if cache.started and not cache.in_flight and cache.get_seq_length() != held_before:
            cache.forward_failed()
        raise
    finally:
        if hasattr(cache, "generate_prompt"):
            cache.generate_prompt = outer


def check_continues(cache, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    cut: bool = True) -> None:
    """InvalidInputError (after resetting `cache`) if `input_ids` [batch, n] has other rows than the cache, or its
    first columns are not the tokens the cache holds followed by at least one new token. `cut` (past_key_values):
    generate takes the input for the held tokens followed by new ones only where it is longer than them and a mask,
    if any, is as long as the input (else the hooks check its positions). Without `cut` (Mamba2's cache_params, no
    positions to check) every input must continue the held tokens so. Multimodal content keys stand for any
    placeholder id (not for text)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return
    seen, held = cache.get_seq_length(), cache.held_tokens()
    if held.shape[0] == input_ids.shape[0]:
        if cut and input_ids.shape[1] <= seen:
            return  # (no longer input: its positions are checked by the hooks)
        masked_apart = isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != input_ids.shape[1]
        if cut and masked_apart:
            return  # only the new tokens were passed (the mask spans the held ones too): generate does not cut
        if input_ids.shape[1] > seen and held.shape[1] == seen and _same_tokens(cache, input_ids[:, :seen].cpu(), held):
            return
    cache.reset()
    raise InvalidInputError(
        f"this HybridPrefixCache holds {seen} tokens of a request in {held.shape[0]} rows, and the input passed to "
        f"generate() ({input_ids.shape[0]} rows) does not continue them: generate would run it on the old request's "
        "states; use a new HybridPrefixCache(store) per request. This cache is reset now (the request it held was "
        "admitted)"
    )


def _same_tokens(cache, fed: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether `fed` [batch, seen] are the `held` tokens, a held content key standing for a placeholder id of the
    model (the pixels behind it are not compared; text in its column is another prompt)."""
    same = fed == held
    keyed = held >= KEY_BASE
    if bool(keyed.any()):
        placeholders = torch.tensor(placeholder_token_ids(cache.store.model.config), dtype=fed.dtype)
        same |= keyed & torch.isin(fed, placeholders)
    return bool(same.all())


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
