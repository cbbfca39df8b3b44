"""The forward hooks through which a model drives its prefix caches.

`generate()` never shows a cache the prompt before its first forward, so the model carries a forward pre-hook and an
always-called post-hook (one pair per model, shared by every store and cache on it). The hooks know only the
`ModelDrivenCache` protocol (driven.py):
- pre-hook, first forward of a cache: `prefixlab_bind(model)` (an unbound cache picks the model's default store, a
  bound one checks it belongs to this model), `begin(...)` -> columns already cached;
- pre-hook, a later forward: it must continue what the cache holds (`held_tokens()` fed again are cut off,
  positions that start elsewhere are refused: a new prompt over a used cache; generate cuts a longer one to what
  continues it, so its input is checked before, guards.checked_generate); one of several tokens (a chunk of a
  chunked prefill, a turn continued on the cache) first skips what the store holds (`resume_further(...)`);
- pre-hook, every forward: the tokens left run in segments split at `capture_splits(...)` (transformers' layers
  capture states only at a forward's end), then `record(input_ids)`; post-hook: `forward_done()` or, if the forward
  raised, `forward_failed()`.
Faults: torch runs the always-called post-hook only for `Exception`s, so a `KeyboardInterrupt` (or any other
BaseException) raised inside a forward would leave a cache half advanced; the hooks therefore also wrap the model's
forward (the forward guard, guards.py) and call `forward_failed()` on the started caches it was given, whatever it
raised. A pre-hook that raises resets its cache the same way. A cache still `in_flight` when its next forward starts
(an interrupt landed between the hooks and the guard: generate was told a stale length) is refused once and reset.
The hooks hold no lock across a forward; the caches take their store's lock in each protocol call (cache/sharing.py).
Direction of the imports: hooks.py <- store.py (installs the hooks: `attach` / `detach`) <- hf.py (HybridPrefixCache
implements the protocol over a PrefixStore). The store never calls a cache except `commit()` on the ones it holds.
"""

from __future__ import annotations

import collections
import inspect
import threading
import weakref

import torch

from prefixlab.cache.align import prime_rows, release_primes
from prefixlab.cache.driven import ModelDrivenCache
from prefixlab.cache.guards import checked_generate, guarded, shadow, unshadow
from prefixlab.cache.media_memo import FeatureMemo, install, serve_namespace, uninstall
from prefixlab.cache.model_info import check_deterministic, check_ids_shape, check_token_ids, check_use_cache
from prefixlab.cache.multimodal import (
    KEY_BASE,
    TOKEN_KEYS,
    MediaTokens,
    computes_positions,
    has_multimodal_inputs,
    text_only,
    with_model_positions,
)
from prefixlab.cache.rows import continues_at, continues_past_masked, continues_plainly, masks_held
from prefixlab.errors import InvalidInputError

# (model ref, store id, holds patch) of stores collected without close(), queued by their finalizers (ownership.py)
COLLECTED: collections.deque = collections.deque()


class _ModelHooks:
    """The hook pair and forward guard of one model and who needs them (stores, `prefixlab.patch`); holds no
    reference to the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cache_arg = cache_keyword(model)
        self.parameters = forward_parameters(model)  # (the guard below keeps the signature: functools.wraps)
        self.media = MediaTokens(model)  # multimodal.py: placeholders read once per model, not per request
        self.own_positions = computes_positions(model)  # M-RoPE: positions follow the images, not the columns
        self.owners: dict[int, int] = {}  # owner -> the encoder memo's bytes it asks for (media_memo.py)
        self.memo = FeatureMemo(0)
        if self.media.keyed_ids:  # keyed images: a repeated one need not be encoded again either
            install(getattr(model, "model", model), self.memo, model)
        self.segment_logits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> split prefill's
        self.splitting: weakref.WeakSet = weakref.WeakSet()  # caches whose first forward runs its split segments
        self.handles = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
        ]
        # weak: _HOOKS must not keep the model (which the wrappers hold) alive
        self.guard = shadow(model, "forward", guarded(model.forward, ModelDrivenCache))
        generate = getattr(model, "generate", None)  # checked: a used cache's input must continue it (guards.py)
        self.checked = shadow(model, "generate", checked_generate(generate, ModelDrivenCache)) if generate else None

    def __deepcopy__(self, memo: dict):  # copy.deepcopy(model) reaches the hooks through the model's hook dicts
        raise InvalidInputError(
            "a model that carries prefixlab's hooks cannot be deep-copied or pickled (the copy's forward would still "
            "run through this model's hooks, memo and forward): close its PrefixStores (and prefixlab.unpatch it) "
            "first, copy it before building a store, or save its weights (state_dict(), save_pretrained)"
        )

    def __reduce__(self):  # torch.save(model), pickle: as deepcopy
        self.__deepcopy__({})

    def remove(self, model: torch.nn.Module) -> None:
        for handle in self.handles:
            handle.remove()
        uninstall(getattr(model, "model", model), model)
        for name, wrapper in (("forward", self.guard), ("generate", self.checked)):
            unshadow(model, name, wrapper)

    def _cache(self, kwargs: dict) -> ModelDrivenCache | None:
        cache = kwargs.get(self.cache_arg, kwargs.get("past_key_values"))
        return cache if isinstance(cache, ModelDrivenCache) else None

    @torch.compiler.disable  # bookkeeping on token ids and the store (model.compile() would trace it): eager
    def before_forward(self, module, args: tuple, kwargs: dict):
        cache = self._cache(kwargs)
        serve_namespace(getattr(cache, "namespace", None))  # the encoder memo's key (media_memo.py)
        if cache is None:
            if COLLECTED:  # a store dropped without close(): its hooks and patch go now, not at prefixlab's next call
                from prefixlab.cache.ownership import release_collected

                release_collected()
            return None
        try:
            return self._prepare(module, cache, args, kwargs)
        except BaseException:  # the forward will not run: the cache must not look half begun
            if cache.started:
                cache.forward_failed()
            raise

    def _prepare(self, module, cache: ModelDrivenCache, args: tuple, kwargs: dict):
        if cache.in_flight:  # its last forward died where neither hook nor guard saw it (an interrupt between them)
            raise InvalidInputError(
                "this HybridPrefixCache's previous forward was interrupted before it ended, so generate() was told a "
                "wrong cache length; the cache is reset now: run the request again (or use a new cache)"
            )
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
        if kwargs.get("ple_input_ids") is not None:  # Qwen4-Exp reads its n-grams from input_ids without them
            raise InvalidInputError("with HybridPrefixCache, leave out ple_input_ids (the model reads input_ids, "
                                    "which the cache shortens to the tokens it does not hold)")
        check_ids_shape(kwargs["input_ids"])
        if not cache.started or kwargs["input_ids"].shape[1] > 1:  # before any lookup (a later turn looks up too)
            check_token_ids(kwargs["input_ids"], module)  # (decode steps feed generate's own tokens: unchecked)
        check_deterministic(module)  # every forward: a later turn on a started cache may run in training mode
        if not cache.started or cache.store.decode_differs:  # (a later call continuing the cache too)
            check_use_cache(module, kwargs.get("use_cache"))  # every row, before any lookup or a default store
        cache.prefixlab_bind(module)  # after the input checks: refused input creates no default store
        if kwargs.get("labels") is not None:
            raise InvalidInputError(
                "HybridPrefixCache serves inference: the forward runs only the tokens after the reused prefix, so "
                "labels cannot line up; compute the loss without the cache"
            )
        splitting = cache in self.splitting  # a segment of a split forward: it only continues the request
        if not cache.started:
            if self.own_positions and kwargs.get("position_ids") is None:  # what the model would compute, whole
                kwargs = with_model_positions(module, kwargs)
            kwargs = self.media.keyed(module, kwargs, first=True)  # the ids the store sees: images keyed by content
            if TOKEN_KEYS not in kwargs and self.media.reusable(kwargs) is None:  # (text: rows primed alone)
                prime_rows(module, cache, kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"),
                           _logits_tokens(kwargs), self.cache_arg, "logits_to_keep" in self.parameters)
            try:
                start = cache.begin(kwargs.get(TOKEN_KEYS, kwargs["input_ids"]), kwargs.get("attention_mask"),
                                    kwargs.get("position_ids"), _logits_tokens(kwargs), self.media.reusable(kwargs))
            finally:
                release_primes(cache)
            offset = 0
        else:
            kwargs = _continuing(module, cache, kwargs, self.media, not splitting, self.own_positions,
                                 "position_ids" not in self.parameters)
            start = offset = cache.get_seq_length()
        if "position_ids" in self.parameters and not (offset and self.own_positions):  # (M-RoPE: the model's own)
            kwargs = with_column_positions(kwargs, offset)  # the forward (or its segments) at its columns
        if not splitting:
            self.segment_logits.pop(cache, None)  # a split forward interrupted before its post-hook left one
        if not splitting and kwargs["input_ids"].shape[1] > 1:  # (a decode step has nothing to split)
            self.splitting.add(cache)  # its segments continue the request: not a lookup each (resume_further)
            try:
                kwargs, segments = _run_splits(module, cache, kwargs, start, offset, self.parameters, self.media)
            finally:
                self.splitting.discard(cache)
            if segments is not None:
                self.segment_logits[cache] = segments
        kwargs = dict(kwargs)
        keys = kwargs.pop(TOKEN_KEYS, None)  # (the hooks' own: never the model's)
        cache.record(kwargs["input_ids"] if keys is None else keys)
        return (), kwargs

    @torch.compiler.disable
    def after_forward(self, module, args: tuple, kwargs: dict, output) -> None:
        cache = self._cache(kwargs)
        if cache is None or not cache.started:
            return
        segments = self.segment_logits.pop(cache, None)
        if output is None:  # the forward raised an Exception (the guard resets on the others)
            cache.forward_failed()
            return None
        cache.forward_done()
        return _join_logits(output, segments) if segments is not None else None


_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelHooks
_HOOKS_LOCK = threading.Lock()  # stores on one model may be built and closed from several threads


def attach(model: torch.nn.Module, owner: object, media_cache_bytes: int = 0) -> None:
    """Make sure `model` carries the hooks; `owner` (a store, or the model itself for `prefixlab.patch`) keeps
    them there until it calls `detach`. The encoder memo holds the most any owner asks for."""
    with _HOOKS_LOCK:
        hooks = _HOOKS.get(model)
        if hooks is None:
            hooks = _HOOKS[model] = _ModelHooks(model)
        hooks.owners[id(owner)] = media_cache_bytes
        hooks.memo.resize(max(hooks.owners.values()))


def detach(model: torch.nn.Module, owner: object, owner_id: int | None = None) -> None:
    """`owner` (or the collected one of `owner_id`) no longer needs the hooks; the last one out removes them."""
    with _HOOKS_LOCK:
        hooks = _HOOKS.get(model)
        if hooks is None:
            return
        hooks.owners.pop(id(owner) if owner_id is None else owner_id, None)
        if not hooks.owners:
            hooks.remove(model)
            del _HOOKS[model]
        else:
            hooks.memo.resize(max(hooks.owners.values()))


def is_attached(model: torch.nn.Module, owner: object | None = None) -> bool:
    """Whether `model` carries the hooks (for `owner`, when given)."""
    hooks = _HOOKS.get(model)
    return hooks is not None and (owner is None or id(owner) in hooks.owners)


def _continuing(module, cache: ModelDrivenCache, kwargs: dict, media: MediaTokens, resume: bool = True,
                mrope: bool = False, positionless: bool = False) -> dict:
    """The inputs of a forward over a started cache, which must continue what it holds: the held tokens fed again
    and then new ones (Mamba2's generate() feeds the whole sequence on a later call; others pass the positions of
    a feed again) are cut to the new ones; a forward whose positions start elsewhere (a new prompt over a used cache)
    is refused (`mrope`: positions the model offsets past images, checked where they can be: rows.continues_at;
    `positionless`: a model without position_ids). Without positions on a model that takes them, a forward is new
    tokens (the columns it runs at), even when they start like the held ones."""
    input_ids, seen = kwargs["input_ids"], cache.get_seq_length()
    length = input_ids.shape[1]
    if length > 1 and input_ids.shape[0] != (rows := cache.held_tokens().shape[0]):  # (decode steps: generate's own)
        raise InvalidInputError(f"this HybridPrefixCache holds a request of {rows} rows and this forward has "
                                f"{input_ids.shape[0]} (generate repeats the input's rows for num_beams / "
                                "num_return_sequences, not a used cache's): use a new HybridPrefixCache(store), "
                                "whose lookup reuses what this one held. This cache is reset now")
    # (not a decode step: those feed one token; with positions, a feed again starts where the held tokens did)
    given = kwargs.get("position_ids") is not None or positionless or mrope
    if 0 < seen < length and given and continues_at(kwargs.get("position_ids"), 0, cache.row_pads, mrope):
        held, fed = cache.held_tokens(), input_ids
        if bool((held >= KEY_BASE).any()):  # images held keyed by content: the tokens fed again must key the same
            kwargs = media.keyed(module, kwargs, first=False)  # (generate(use_cache=False) re-feeds every step)
            fed = kwargs.get(TOKEN_KEYS, input_ids)
        if held.shape == (fed.shape[0], seen) and torch.equal(fed[:, :seen].cpu(), held):
            kwargs = _slice_inputs(kwargs, seen, length, length, media=media)
    positions = kwargs.get("position_ids")
    if not continues_at(positions, seen, cache.row_pads, mrope) and (
            mrope or not continues_past_masked(positions, kwargs.get("attention_mask"), seen, cache.row_pads)):
        raise InvalidInputError(
            f"this HybridPrefixCache holds {seen} tokens of a request and this forward does not "
            "continue them (its positions start elsewhere: a new prompt would run on the old one's states); use a "
            "new HybridPrefixCache(store) per request. This cache is reset now"
        )
    length = kwargs["input_ids"].shape[1]
    if (length > 1 and cache.store.layout.state_layers
            and masks_held(kwargs.get("attention_mask"), seen, cache.row_pads)):
        raise InvalidInputError(
            f"this forward's attention_mask masks tokens this HybridPrefixCache holds as real ones (of its first {seen}"
            " columns; e.g. a generated pad id marked as a pad in the next turn's mask): the model's recurrent states "
            "already took them in, so the forward cannot be computed as the mask asks; pass a mask of ones over the "
            "tokens the cache holds, or a new HybridPrefixCache(store) with the whole input. This cache is reset now")
    if length == 1:
        cache.check_one_token(kwargs["input_ids"], kwargs.get("attention_mask"))
    elif not continues_plainly(kwargs, seen, cache.row_pads, mrope, getattr(cache, "row_ends", None)):
        cache.admit_nothing()  # other positions past its first column, or pads among its tokens: run as given
        resume = False
    # more of a prompt (chunked prefill, a later turn): the store may hold it already. A one-token forward with media
    # inputs too (an image's placeholder fed alone): keyed, or else what is admitted stops before its placeholder
    if resume and (length > 1 or has_multimodal_inputs(kwargs)):
        kwargs = media.keyed(module, kwargs, first=False)
        skip = cache.resume_further(kwargs.get(TOKEN_KEYS, kwargs["input_ids"]), _logits_tokens(kwargs),
                                    media.reusable(kwargs), kwargs.get("attention_mask"), kwargs.get("position_ids"))
        if skip:  # columns [seen, seen + length) run from seen + skip
            kwargs = _slice_inputs(kwargs, seen + skip, seen + length, seen + length, offset=seen, media=media)
    return kwargs


def _logits_tokens(kwargs: dict) -> int:
    """The forward's last tokens whose logits the caller asked for, which must be computed: `logits_to_keep` (0: none
    in particular, the outputs cover the tokens run), or every token (a tensor of indices names columns of the whole
    input)."""
    keep = kwargs.get("logits_to_keep", 0)
    return keep if isinstance(keep, int) else kwargs["input_ids"].shape[1]


def _run_splits(module, cache: ModelDrivenCache, kwargs: dict, start: int, offset: int, params: frozenset[str],
                media: MediaTokens | None = None) -> tuple[dict, tuple | None]:
    """Run the forward's tokens up to each planned capture split (`kwargs` holds the tokens of columns [offset,
    offset + n), the first `start - offset` of them already held); return the last segment's kwargs and, when the
    caller asked for logits the earlier segments computed, (their logits, the caller's logits_to_keep). `media`: the
    forward's placeholders: each part gets the features of its own (multimodal.py)."""
    length = offset + kwargs["input_ids"].shape[1]
    # per-layer outputs of segments cannot be joined (attentions span other keys): such a forward runs whole
    splits = [] if _asks_layer_outputs(module, kwargs) else cache.capture_splits(start, length)
    keep = kwargs.get("logits_to_keep", 0)
    # generate keeps 1 logit (the last segment has it); a direct forward may want every token's
    collect = bool(splits) and not (isinstance(keep, int) and 0 < keep <= length - splits[-1])
    logits = []
    for stop in splits:
        # unkeyed: splits come before any placeholder (the cache plans none past it): plain text, run without media
        segment = _slice_inputs(kwargs, start, stop, length, offset, media)
        segment = text_only(segment, keep_features=TOKEN_KEYS in segment)
        if "logits_to_keep" in params:
            segment["logits_to_keep"] = 0 if collect else 1  # else only the states matter here
        output = module(**segment)
        if collect:
            logits.append(_logits_of(output))
        start = stop
    last = _slice_inputs(kwargs, start, length, length, offset, media)
    if collect and "logits_to_keep" in params:
        last["logits_to_keep"] = 0
    return last, (logits, keep) if collect else None


_LAYER_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")


def _asks_layer_outputs(module, kwargs: dict) -> bool:
    """Whether the forward returns per-layer outputs besides the logits (hidden states, attentions, MoE router
    logits), asked for by its keywords or else the model's config; a hidden-state index (even 0) asks too."""
    config = getattr(module, "config", None)
    for name in _LAYER_OUTPUTS:
        value = kwargs.get(name)
        value = getattr(config, name, None) if value is None else value
        if value is not None and value is not False:
            return True
    return False


def _join_logits(output, segments: tuple):
    """The output of a split prefill with the logits of every segment, cut to the caller's logits_to_keep (indices:
    of the forward's columns, all run: `_logits_tokens`)."""
    logits, keep = segments
    last = _logits_of(output)
    if last is None:
        return output
    joined = torch.cat([*logits, last], dim=-2)
    if not isinstance(keep, int):
        joined = joined[..., keep.to(joined.device), :]
    joined = joined[..., -keep:, :] if isinstance(keep, int) and keep else joined
    if isinstance(output, tuple):  # return_dict=False: logits first (labels, hence a loss, are refused)
        return (joined, *output[1:])
    output.logits = joined
    return output


def _logits_of(output) -> torch.Tensor | None:
    """The logits of a forward's output, a ModelOutput or (return_dict=False) a tuple that starts with them."""
    return output[0] if isinstance(output, tuple) else getattr(output, "logits", None)


def forward_parameters(module: torch.nn.Module) -> frozenset[str]:
    return frozenset(inspect.signature(module.forward).parameters)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model takes its cache under in forward() and generate() (Mamba, Falcon-Mamba, Mamba2:
    cache_params)."""
    return "cache_params" if "cache_params" in forward_parameters(model) else "past_key_values"


def _slice_inputs(kwargs: dict, start: int, stop: int, length: int, offset: int = 0,
                  media: MediaTokens | None = None) -> dict:
    """Model inputs for columns [start, stop) of a call over columns [offset, length): per-token inputs are cut (with
    `media`, the pre-encoded features too), the 2D attention mask keeps every column up to `stop` (it spans cached +
    new tokens)."""
    out = dict(kwargs if media is None else media.sliced(kwargs, start - offset, stop - offset))  # (never the caller's)
    for name in ("input_ids", "position_ids", "token_type_ids", TOKEN_KEYS):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == length - offset:
            out[name] = value[..., start - offset:stop - offset]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out["attention_mask"] = mask[:, :stop]
    return out


def with_column_positions(kwargs: dict, first: int) -> dict:
    """`kwargs` with position_ids = first, first + 1, ... for its input_ids when the caller passed none: what the
    model counts for a forward after `first` cached tokens. Some models (Bamba) count from 0 on every call instead,
    so the forwards the hook shortens, splits or continues get the positions of the whole sequence."""
    if kwargs.get("position_ids") is not None:
        return kwargs
    input_ids = kwargs["input_ids"]
    positions = torch.arange(first, first + input_ids.shape[1], device=input_ids.device)
    # one row per batch row, as models count them (Qwen4-Exp appends them to its per-row indexer positions)
    return kwargs | {"position_ids": positions.expand(input_ids.shape[0], -1)}
