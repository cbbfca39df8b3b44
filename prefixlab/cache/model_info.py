"""What a PrefixStore needs to know about a model: byte capacities, which cache layers hold KV or states, identity,
which token ids it can embed."""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import re
from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from prefixlab.cache.devices import execution_device
from prefixlab.cache.hfspec import (
    MODEL_FAMILIES,
    family_of,
    fresh_states,
    keeps_conv_state,
    keeps_recurrent_state,
    pads_shift_positions,
)
from prefixlab.cache.weights import rope_types
from prefixlab.errors import InvalidInputError, ModelMismatchError, UnsupportedModelError, is_int
from prefixlab.recurrent.families.mamba2 import NO_DT_LIMIT, time_step_limit

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TRAINING = operator.attrgetter("training")
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_capacity(capacity: int | str, name: str = "capacity", zero: bool = False) -> int:
    """Bytes from an int or a string like "4GB" (10**9), "512MiB" (2**20), "1.5 GiB"; `zero`: 0 is a size too."""
    if not is_int(capacity) and not isinstance(capacity, str):  # (numpy integers are ints too; bools are not)
        raise InvalidInputError(f"{name}={capacity!r} must be an int number of bytes or a string like '4GB'")
    if is_int(capacity):
        nbytes = int(capacity)
    else:
        found = _CAPACITY.match(capacity)
        unit = found.group(2).lower() if found else None
        if unit not in _UNITS:
            raise InvalidInputError(
                f"{name}={capacity!r} is not a size; write e.g. '4GB', '512MiB' or an int number of bytes"
            )
        nbytes = int(float(found.group(1)) * _UNITS[unit])
    if nbytes < 0 or (nbytes == 0 and not zero):
        raise InvalidInputError(f"{name}={capacity!r} must be a positive number of bytes"
                                if not zero else f"{name}={capacity!r} must be a number of bytes >= 0 (0 keeps none)")
    return nbytes


@dataclass(frozen=True)
class CacheLayout:
    """Which cache layers hold attention KV and which hold recurrent (conv + recurrent) states."""

    kv_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...] = ()  # those of state_layers whose states hold a recurrent state besides conv
    conv_layers: tuple[int, ...] | None = None  # those of state_layers holding a conv state (None: all of them)
    # those of kv_layers whose attention runs a sparse-attention indexer (DSA) caching per-token keys beside K and V
    indexer_layers: tuple[int, ...] = ()
    # ((layer, state index), value) of conv states whose fresh value is not 0 (Qwen4-Exp's n-gram context: eos)
    fresh: tuple[tuple[tuple[int, int], int], ...] = ()
    # the layer keeping the indexers' position history, rebuilt on a resume (Qwen4-Exp: its first indexed layer)
    position_history: int | None = None

    @classmethod
    def from_config(cls, config) -> CacheLayout:
        layers = DynamicCache(config=config).layers
        for index, layer in enumerate(layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise UnsupportedModelError(
                    f"layer {index} is a sliding-window attention layer ({type(layer).__name__}); its cache drops "
                    "old tokens, so prefixes cannot be reused from it. Disable sliding windows to use prefixlab "
                    "where the model allows it (sliding_window=None, use_sliding_window=False); a model built with "
                    "sliding-window layer types (as LFM3 checkpoints are) is not served"
                )
            if not isinstance(layer, DynamicLayer | LinearAttentionCacheLayerMixin | DummyLayer):
                raise UnsupportedModelError(f"layer {index} uses cache layer {type(layer).__name__}, not supported")
        state_layers = tuple(i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin))
        family = family_of(config)
        # GLM-5-Next's "shared" layers reuse the previous layer's selection and never write their indexer keys
        indexer_types = getattr(config.get_text_config(decoder=True), "indexer_types", None) or ()
        indexer_layers = tuple(i for i, layer in enumerate(layers) if isinstance(layer, DynamicIndexedLayer)
                               and dict(enumerate(indexer_types)).get(i) != "shared")
        return cls(
            kv_layers=tuple(i for i, layer in enumerate(layers) if isinstance(layer, DynamicLayer)),
            state_layers=state_layers,
            recurrent_layers=state_layers if keeps_recurrent_state(config) else (),
            conv_layers=state_layers if keeps_conv_state(config) else (),
            indexer_layers=indexer_layers,
            fresh=tuple(sorted(fresh_states(config).items())),
            position_history=indexer_layers[0] if indexer_layers and family.indexer_positions else None,
        )


# Model types whose transformers layers restart multi-token forwards from a zero recurrent state (ignoring the
# cached one): reuse is exact there only through prefixlab.recurrent.patch, whose layers resume from the cache.
STATE_DROPPING_MODEL_TYPES = {model_type: family.patched_only for model_type, family in MODEL_FAMILIES.items()
                              if family.patched_only}


def decode_differs_from_prefill(model: torch.nn.Module) -> bool:
    """Whether a token decoded over a cached state is computed differently from the same token inside a prefill.
    transformers' Mamba2 mixers (like mamba_ssm's) clamp dt to their `time_step_limit` in the chunked form of a
    forward only, not in the recurrent form it takes for one token over a cached state. Where that limit is not (0,
    inf) (Nemotron-H and Zamba2 use (time_step_min, inf)) a decoded token whose dt the limit would change, and
    everything after it, is not what a prefill of the same tokens computes: a store must not serve it to later
    prompts (patched layers report such tokens, cache/hf.py) nor resume a prompt one token before its end (that
    token would run in the recurrent form)."""
    return any(time_step_limit(m) != NO_DT_LIMIT for m in model.modules() if hasattr(m, "time_step_limit"))


def check_use_cache(model: torch.nn.Module, use_cache: bool | None) -> None:
    """InvalidInputError for use_cache=False (the forward's, else the config's) where decode steps differ from
    prefills: generate then feeds the whole sequence again at every step, which a started cache cuts to the new
    token, a decode step, not the prefill that was asked for."""
    use_cache = getattr(model.config, "use_cache", True) if use_cache is None else use_cache
    if use_cache is False and decode_differs_from_prefill(model):
        raise InvalidInputError(
            f"use_cache=False with a HybridPrefixCache on {type(model).__name__}: generate would feed the whole "
            "sequence again at every step and the cache would run its new token as a decode step, which this model "
            "computes differently from the prefill use_cache=False asks for (see store.decode_differs); pass "
            "use_cache=True, or no cache"
        )


# config fields that change what a forward returns, or describe the model, not what it computes
_OUTPUT_FIELDS = ("output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "pad_token_id",
                  "bos_token_id", "eos_token_id", "architectures", "id2label", "label2id", "task_specific_params",
                  "finetuning_task", "tokenizer_class", "problem_type", "prefix", "num_logits_to_keep")


def model_identity(model: torch.nn.Module, output_fields: bool = False) -> str:
    """Checksum of what makes cached tensors valid for a model: its config (but the fields that only choose what a
    forward returns; `output_fields=True`: with them, as earlier store files recorded it) and dtype."""
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
                     *(() if output_fields else _OUTPUT_FIELDS)):
        config.pop(volatile, None)
    text = json.dumps(config, sort_keys=True, default=str) + f"|{model.dtype}"
    return hashlib.sha256(text.encode()).hexdigest()


def check_config_still_served(model: torch.nn.Module, layout: CacheLayout) -> None:
    """After the model's config changed under a store: ModelMismatchError unless it still gives the store's layout
    and passes the checks the store was built with (a resized vocabulary does; a sliding window does not)."""
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.errors import PrefixlabError

    try:
        served = CacheLayout.from_config(model.config) == layout
        ModelSpec.from_config(model.config, dtype=model.dtype)
    except PrefixlabError:
        served = False
    if not served:
        raise ModelMismatchError("the model's config changed since this PrefixStore was built for it, into one it "
                                 "does not serve as built: store.close() and build a new PrefixStore(model, ...)")


def pads_change_states(model: torch.nn.Module) -> bool:
    """Whether a left pad changes a row's recurrent states on this model: transformers zeroes padded positions
    before a linear-attention layer's input projection, but a non-zero bias there (Mamba2's `use_bias`, Bamba /
    Falcon-H1 / Jamba / Zamba `mamba_proj_bias`, Zamba2 `add_bias_linear`, LFM2 `conv_bias`) makes them non-zero
    again, and they enter the conv window of the row's first tokens and every state after. A padded row's states then
    depend on its pads: such rows can neither be stored nor resumed as the row alone. A family names its own such
    projections (`pad_projections`: ZAYA's q_proj / k_proj, `attention_bias`). Where pads shift the positions a row's
    tokens are computed at (hfspec.pads_shift_positions: Inkling's log scaling), they change every state and KV
    after them."""
    from prefixlab.recurrent.families import family_of
    from prefixlab.recurrent.patch import looks_linear_attention

    if pads_shift_positions(model.config):
        return True

    def feeds_states(layer: torch.nn.Module, name: str) -> bool:
        named = getattr(family_of(layer), "pad_projections", None)
        return name.startswith("in_proj") if named is None else name in named

    return any(isinstance(child, torch.nn.Linear) and feeds_states(layer, name) and child.bias is not None
               and bool(child.bias.detach().any())
               for layer in model.modules() if looks_linear_attention(layer) for name, child in layer.named_children())


def rope_limit(model: torch.nn.Module) -> int | None:
    """The sequence length from which the model's RoPE rescales its frequencies ("dynamic", "longrope": transformers'
    dynamic_rope_update), if it has such a RoPE: every position's frequencies then depend on the whole forward's
    length (and, for "dynamic", on the longest one before), so only what runs below it can be reused exactly."""
    limits = []
    for module in model.modules():
        for layer_type, kind in rope_types(module):
            if kind == "longrope":
                parameters = module.config.rope_parameters
                parameters = parameters if layer_type is None else parameters[layer_type]
                limits.append(int(parameters["original_max_position_embeddings"]))
            elif "dynamic" in kind:
                limits.append(int(module.original_max_seq_len))
    return min(limits, default=None)


def runs_uncached(store, pads: list[int], length: int) -> bool:
    """Whether a left-padded batch of `length` columns must run uncached, nothing reused or admitted: its pads change
    the model's states (pads_change_states), or it reaches the model's RoPE rescaling (rope_limit)."""
    return (max(pads) > 0 and store.pads_change_states) or (store.rope_limit is not None and length >= store.rope_limit)


def check_ids_shape(ids: object) -> None:
    """InvalidInputError unless `ids` is a [batch, length] tensor (what the store keys rows and columns by)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = f"shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InvalidInputError(f"input_ids must be a [batch, length] tensor, got {got}; pass one sequence as "
                                "input_ids[None] (or .unsqueeze(0)): nothing was looked up or admitted")


def check_token_ids(ids: torch.Tensor, model: torch.nn.Module) -> None:
    """InvalidInputError if `ids` are not a [batch, length] tensor of integers, or naming the first row with a token
    id outside the model's embedding table."""
    check_ids_shape(ids)
    if ids.dtype not in (torch.int64, torch.int32):  # what an embedding takes (not bool, uint8, floats)
        raise InvalidInputError(
            f"input_ids must hold integer token ids (int64 or int32), got dtype {ids.dtype}; pass e.g. "
            "input_ids.long(): nothing was looked up or admitted"
        )
    try:
        vocab = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab = getattr(model.config, "vocab_size", None)
    bad = (ids < 0) | (ids >= vocab) if vocab else ids < 0
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        raise InvalidInputError(
            f"input_ids[{row}, {column}] = {int(ids[row, column])} is not a token id of this model (0 <= id < "
            f"{vocab}); fix the batch: nothing was looked up or admitted"
        )


_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)


# torch.backends settings that let fp32 matmuls and convolutions run in TF32 / bf16 passes (the newer fp32_precision
# API and the older flags; attributes a torch version lacks read as None)
_PRECISION_SETTINGS = ("fp32_precision", "cuda.matmul.fp32_precision", "cuda.matmul.allow_tf32", "cudnn.allow_tf32",
                       "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision",
                       "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision")


def numeric_context() -> tuple:
    """The process-wide settings that change what a forward computes beyond its inputs and weights: the float32
    matmul precision and the TF32 / bf16 settings of torch.backends."""
    def read(get) -> object:
        try:
            return get()
        except RuntimeError:  # torch refuses legacy reads once the new fp32_precision API set backends apart
            return "mixed"

    def setting(path: str) -> object:
        value = torch.backends
        for name in path.split("."):
            value = getattr(value, name, None)
        return value

    return (read(torch.get_float32_matmul_precision),
            *(read(functools.partial(setting, path)) for path in _PRECISION_SETTINGS))


def check_deterministic(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> None:
    """InvalidInputError under torch.autocast (the model then computes in another precision than its dtype: entries
    would be exact for neither), or if `model` is in training mode with dropout or MoE router jitter noise active
    (its outputs are random then, so what it computes can neither be stored as the prefix's KV and states nor stand
    in for them) or gradient checkpointing on (its layers then ignore the cache). `modules` (all of the model's,
    e.g. a kept walk's): a model in eval mode is checked for submodules in training mode too (Monte-Carlo dropout:
    `model.eval()`, then some modules `.train()`)."""
    device_type = execution_device(model).type
    if torch.is_autocast_enabled(device_type):
        raise InvalidInputError(
            f"torch.autocast({device_type!r}) is on: the model would compute in {torch.get_autocast_dtype(device_type)}"
            f" where its weights are {model.dtype}, so stored prefixes would match neither precision; convert the "
            "model instead (model.to(torch.bfloat16)) and run it outside autocast with a HybridPrefixCache"
        )
    if not model.training and (modules is None or not any(map(_TRAINING, modules))):
        return
    modules = list(model.modules()) if modules is None else modules
    if any(module.training and getattr(module, "gradient_checkpointing", False) is True for module in modules):
        raise InvalidInputError(
            "the model (or some of its modules) is in training mode with gradient checkpointing on: its layers then "
            "drop the cache "
            "(transformers runs them with use_cache=False), so a reused prefix would be silently ignored; call "
            "model.eval() (or model.gradient_checkpointing_disable()) before running it with a HybridPrefixCache"
        )
    active = [f"{name}.{attribute}" if attribute else name for name, module in model.named_modules()
              if module.training for attribute in _random_in_training(module)]
    if active:
        raise InvalidInputError(
            f"the model (or some of its modules) is in training mode with dropout active or MoE jitter noise "
            f"({', '.join(active[:3])}{', ...' if len(active) > 3 else ''}): its outputs are random, so prefixes "
            "cannot be reused or stored exactly; call model.eval() before running it with a HybridPrefixCache"
        )


# rates transformers' modules apply only in training mode, by attribute: attention dropout, and the noise MoE routers
# multiply their input by (MiniMax, Mixtral, PhiMoE: router_jitter_noise / input_jitter_noise)
_RANDOM_RATES = ("attention_dropout", "jitter_noise", "router_jitter_noise", "input_jitter_noise")


def _random_in_training(module: torch.nn.Module) -> list[str]:
    """What makes `module` random in training mode: "" for a dropout module with p > 0, else its rate attributes > 0."""
    if isinstance(module, _DROPOUTS):
        return [""] if module.p > 0 else []
    return [name for name in _RANDOM_RATES
            if isinstance(rate := getattr(module, name, None), float) and rate > 0]
