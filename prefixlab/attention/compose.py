"""Hydragen over a PrefixStore hit: the prefix served from the store is the level every sequence shares.

    store = PrefixStore(model, capacity="4GB")          # model.set_attn_implementation("hydragen")
    cache = hydragen_cache_from_store(store, prompt_ids, batch_size=8)
    model.generate(prompt_ids, num_return_sequences=8, past_key_values=cache, ...)

The store is asked for the longest reusable prefix of the prompt (all but its last token, so the model still
yields logits), on the device tier or the host tier when that one reuses more; copies of its attention KV are loaded
ONCE into a `HydragenCache` (no batch axis, not one copy per sequence) and its recurrent + conv states, for hybrid
models, once per sequence (recurrent layers run per sequence). The match is released before returning: the cache
owns its copies, the store may evict the entry afterwards. `generate` sees `get_seq_length() == reused tokens` and
feeds only the rest of the prompt; the N identical rows of that remainder are shared by `HydragenCache` too.

The store's forward hooks drive `HybridPrefixCache` instances only, so they leave this cache alone: the completions
are NOT admitted back into the store (their KV sits in Hydragen's shared + suffix layout, and nothing is recorded).
To cache a continuation (e.g. the chosen answer before the next chat turn), run it through `HybridPrefixCache(store)`.
"""

from __future__ import annotations

import weakref

import torch

from prefixlab.attention.hf_cache import HydragenCache, SharedPrefixLayer
from prefixlab.cache.defaults import check_unconverted
from prefixlab.cache.devices import layer_devices
from prefixlab.cache.model_info import check_deterministic, check_token_ids
from prefixlab.cache.store import PrefixStore, model_identity
from prefixlab.cache.tensors import TOKEN_AXIS, TensorState
from prefixlab.cache.tokens import check_namespace
from prefixlab.cache.weights import weights_version
from prefixlab.errors import InvalidInputError, ModelMismatchError, UnsupportedModelError, is_int


def hydragen_cache_from_store(
    store: PrefixStore,
    prompt_ids: torch.Tensor,
    batch_size: int,
    namespace: str = "default",
    model: torch.nn.Module | None = None,
) -> HydragenCache:
    """A `HydragenCache` whose shared level is the store's cached prefix of `prompt_ids`, for `batch_size` sequences.

    Args:
        store: the PrefixStore of the model that will generate.
        prompt_ids: (1, T) token ids; every sequence of the batch starts with them.
        batch_size: sequences `generate` will run (num_return_sequences, or the rows of a repeated prompt).
        namespace: the store namespace to match in.
        model: the model that will generate, if not `store.model`; it must have the store's config and dtype.
    Returns the cache; `cache.get_seq_length()` is the number of prompt tokens served from the store (0 on a miss:
    plain Hydragen prefill), at most all but the prompt's last token (last two on Nemotron-H / Zamba2, whose decode
    steps differ from prefills). The store is left as it was (the match is released, nothing is admitted).
    """
    if not isinstance(store, PrefixStore):
        raise InvalidInputError(f"store must be a PrefixStore, got {type(store).__name__}")
    model = store.model if model is None else model
    if model is not store.model and model_identity(model) != store.identity:
        raise ModelMismatchError(
            f"the store caches tensors of another model ({store.identity[:12]}, {store.model.dtype}) than "
            f"{type(model).__name__} ({model_identity(model)[:12]}, {model.dtype}); config or dtype differ. "
            "Use the PrefixStore built for this model"
        )
    check_unconverted(store, model)
    if model is not store.model:
        _check_same_weights(store.model, model)
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 \
            or prompt_ids.shape[1] == 0 or prompt_ids.is_floating_point():
        raise InvalidInputError(
            f"prompt_ids must be a (1, T>0) tensor of token ids, got {getattr(prompt_ids, 'shape', prompt_ids)}; "
            "for several prompts build one cache per prompt"
        )
    check_token_ids(prompt_ids, model)  # before the lookup: generate would fail deep in torch on such an id
    check_deterministic(model)  # dropout active: the cache would hold what generate then computes differently
    if not is_int(batch_size) or batch_size < 1:
        raise InvalidInputError(f"batch_size={batch_size!r} must be a positive int (the sequences generate runs)")
    batch_size = int(batch_size)
    check_namespace(namespace)
    cache = HydragenCache(model.config)  # refuses models whose attention cannot read shared KV, before any lookup
    attention = [i for i, layer in enumerate(cache.layers) if isinstance(layer, SharedPrefixLayer)]
    if not attention:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no attention layer HydragenCache can share (none, or its KV kept in a cache "
            "layer shared with a recurrent one): serve it with HybridPrefixCache(store)"
        )
    if tuple(attention) != store.layout.kv_layers:
        raise ModelMismatchError(f"the store holds KV of layers {store.layout.kv_layers}, the model has {attention}")
    probe = prompt_ids[0, : -store.min_prefill_tokens].detach().cpu().numpy()  # generate runs the rest
    if store.rope_limit is not None and prompt_ids.shape[1] >= store.rope_limit:  # (the prompt runs rescaled)
        probe = probe[:0]
    store.check_weights()
    match, source = store.lookup(probe, namespace)
    try:
        shared = _prefix_tensors(source, attention, layer_devices(model, store.walk), store.device)
    finally:
        store.release_lookup(match, source)
    cache.load_shared_prefix(**shared, batch_size=batch_size)
    return cache


_SAME_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the versions last found equal


def _check_same_weights(owner: torch.nn.Module, model: torch.nn.Module) -> None:
    """ModelMismatchError unless `model` holds the weights of `owner` (the store's model, which computed every entry):
    another object of the same config, other weights, was served KV and states it would not have computed. Compared
    value by value, again only when either model's weights version changed."""
    versions = (id(owner), weights_version(owner), weights_version(model))
    if _SAME_WEIGHTS.get(model) == versions:
        return
    ours, theirs = owner.state_dict(), model.state_dict()
    differ = sorted(set(ours) ^ set(theirs)) or [
        name for name, tensor in ours.items() if not tensor.is_meta and not theirs[name].is_meta
        and (tensor.shape != theirs[name].shape or not torch.equal(tensor, theirs[name].to(tensor.device)))]
    if differ:
        raise ModelMismatchError(
            f"{type(model).__name__} has the store's config but other weights ({differ[0]} differs): the store's "
            "entries were computed with its own model's weights. Use the PrefixStore built for this model"
        )
    _SAME_WEIGHTS[model] = versions


def _prefix_tensors(match, attention: list[int], devices: dict[int, torch.device], device: torch.device) -> dict:
    """`load_shared_prefix` arguments: fresh copies of the match's KV[:length] and its state, each layer's on its
    device (`devices`, else `device`)."""
    if not match.length:  # a miss: an empty shared level (the batch size still checked by the cache)
        empty = torch.empty(0, 0, 0, device=device)
        return {"keys": {i: empty for i in attention}, "values": {i: empty for i in attention}}

    def joined(side: str, layer: int) -> torch.Tensor:
        pieces = [getattr(kv, side)[layer] for kv in match.kv]
        joined = torch.cat(pieces, dim=TOKEN_AXIS)[:, : match.length]  # cat copies
        return joined.to(devices.get(layer, device)).contiguous()

    shared = {side: {i: joined(side, i) for i in attention} for side in ("keys", "values")}
    state: TensorState | None = match.state
    for kind in ("conv", "recurrent"):
        per_layer = getattr(state, kind) if state is not None else {}
        if any(index != 0 for _, index in per_layer):
            raise UnsupportedModelError(
                "this model keeps several recurrent states per layer; HydragenCache.load_shared_prefix takes one"
            )
        # TensorState has no batch axis; load_shared_prefix copies a batch-1 state per sequence
        shared[f"{kind}_states"] = {layer: t.unsqueeze(0).to(devices.get(layer, device))
                                    for (layer, _), t in per_layer.items()}
    return shared
