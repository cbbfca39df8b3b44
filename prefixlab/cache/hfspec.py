"""What prefixlab knows per transformers model_type: MODEL_FAMILIES (the one table a new family is added to: its
cost-model reader in readers.py / readers_ssm.py, the layer family that patches it, how it resumes) and `ModelSpec`
from a transformers (5.x) config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixlab.cache import costmodel as cm
from prefixlab.cache import readers as rd
from prefixlab.cache import readers_ssm as ssm
from prefixlab.errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelFamily:
    """One model_type: `reader` (config, dtype bytes) -> its ModelSpec layer groups; `layer_family`, the
    prefixlab.recurrent.families class that patches its linear-attention layers (None: KV-only); `patched_only`, why
    transformers' own layers cannot resume exactly (then only a patched model is served); `fresh_states`, the conv
    states a fresh sequence does not start at zeros (a batch row resuming nothing gets these); `indexer_positions`,
    whether the model keeps its indexers' position history on its first indexed layer (rebuilt on a resume)."""

    reader: Callable
    layer_family: str | None
    patched_only: str | None = None
    fresh_states: Callable | None = None  # config -> {(layer, state index): fresh value} where that is not 0
    indexer_positions: bool = False  # its first indexed layer keeps the indexers' position history (Qwen4-Exp)


# transformers 5.23's Mamba1 mixers (Jamba, Mamba, Falcon-Mamba) never hand the cached recurrent state to a
# multi-token scan (mamba_selective_scan and mamba_ssm's selective_scan_fn take none; the torch loop starts at zeros)
_MAMBA1_RESTARTS = "{}'s multi-token scan starts from zeros, not from the cached state (transformers 5.23)"

# Adding a family: its row here (and its reader above; a new kind of recurrent layer also needs a
# prefixlab.recurrent.families class). tests/test_hf_families.py checks `layer_family` against a tiny model.
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "qwen3_5": ModelFamily(rd.qwen3_5, "GatedDeltaNet"),
    "qwen3_5_moe": ModelFamily(rd.qwen3_5_moe, "GatedDeltaNet"),
    "qwen3_next": ModelFamily(rd.qwen3_next, "Qwen3NextGatedDeltaNet"),
    "qwen4_exp": ModelFamily(rd.qwen4_exp, "GatedDeltaNet", fresh_states=rd.qwen4_exp_fresh, indexer_positions=True),
    "olmo_hybrid": ModelFamily(rd.olmo_hybrid, "OlmoHybridGatedDeltaNet"),
    "kimi_linear": ModelFamily(rd.kimi_linear, "KimiDeltaAttention"),
    "glm5_next": ModelFamily(rd.glm5_next, "KimiDeltaAttention"),
    "nemotron_h": ModelFamily(ssm.nemotron_h, "Mamba2Mixer"),
    "bamba": ModelFamily(ssm.bamba, "Mamba2Mixer"),
    "falcon_h1": ModelFamily(ssm.falcon_h1, "FalconH1Mixer"),
    "granitemoehybrid": ModelFamily(ssm.granitemoehybrid, "Mamba2Mixer"),
    "zamba2": ModelFamily(ssm.zamba2, "Mamba2Mixer"),
    "zamba": ModelFamily(ssm.zamba, "MultiHeadMambaMixer", patched_only=_MAMBA1_RESTARTS.format("ZambaMambaMixer")),
    "mamba2": ModelFamily(ssm.mamba2_model, "Mamba2Mixer"),
    "jamba": ModelFamily(ssm.jamba, "NormalisedMambaMixer", patched_only=_MAMBA1_RESTARTS.format("JambaMambaMixer")),
    "mamba": ModelFamily(ssm.mamba_model, "MambaMixer", patched_only=_MAMBA1_RESTARTS.format("MambaMixer")),
    "falcon_mamba": ModelFamily(ssm.mamba_model, "NormalisedMambaMixer",
                                patched_only=_MAMBA1_RESTARTS.format("FalconMambaMixer")),
    "bailing_hybrid": ModelFamily(rd.bailing_hybrid, "BailingHybridDeltaAttention"),
    "lfm2": ModelFamily(rd.lfm2, "ShortConv"),
    "lfm2_moe": ModelFamily(rd.lfm2_moe, "ShortConv"),
    "lfm3": ModelFamily(rd.lfm3, "ShortConv"),
    "zaya": ModelFamily(rd.zaya, "ZayaCCA"),
    "inkling": ModelFamily(rd.inkling, "InlineShortConv"),
    "inkling2": ModelFamily(rd.inkling2, "InlineShortConv"),
    "minimax": ModelFamily(rd.minimax, "LightningAttention"),
    **{model_type: ModelFamily(rd.dense, None) for model_type in rd.DENSE_MODEL_TYPES},
}
READERS: dict[str, Callable] = {model_type: family.reader for model_type, family in MODEL_FAMILIES.items()}

# Hybrid model types that are not served, with why (transformers 5.23) and what it would take: the refusal says so.
REFUSED_MODEL_TYPES: dict[str, str] = {}
SUPPORTED_MODEL_TYPES = tuple(sorted(READERS))


def text_config(config):
    """The config of a model's text decoder (a multimodal config's text config; a text config itself)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_type_of(config) -> str:
    """The MODEL_FAMILIES key of a config: its text config's model_type without a "_text" suffix."""
    return (getattr(text_config(config), "model_type", None) or "").removesuffix("_text")


def family_of(config) -> ModelFamily:
    """The MODEL_FAMILIES row of a config (its text config's), or a row of defaults for a type it does not know."""
    return MODEL_FAMILIES.get(model_type_of(config), ModelFamily(None, None))


def _layer_family(config):
    from prefixlab.recurrent.families import FAMILIES

    return next((f for f in FAMILIES if type(f).__name__ == family_of(config).layer_family), None)


def keeps_recurrent_state(config) -> bool:
    """Whether the model's linear-attention cache layers hold a recurrent state besides the conv state (LFM2's
    short convolutions hold only the conv state). True for a model type this table does not know."""
    layer_family = _layer_family(config)
    return layer_family is None or layer_family.has_recurrent_state


def keeps_conv_state(config) -> bool:
    """Whether the model's linear-attention cache layers hold a conv state (MiniMax's lightning attention has no
    conv). True for a model type this table does not know."""
    return getattr(_layer_family(config), "has_conv_state", True)


def selection_limit(config) -> int | None:
    """The tokens up to which GLM-5-Next's DSA indexer selects every key a query may see, whatever the forward's
    length; None for other models. From there on a query attends to `index_topk // index_kpool` of the complete pools
    before it, picked by `index_scores.topk` over the forward's every pool (transformers 5.23 modeling_glm5_next.py
    :889, masked future pools included), and its ReLU'd scores (:863) tie exactly (at 0) where no head scores a
    pool positive: topk breaks such ties by the row's length, so the same tokens select other keys in a forward of
    another length. A prefix stored from one request would then not be what another request's own prefill computes:
    nothing past this limit is stored or resumed (a longer prompt still reuses its first `limit` tokens)."""
    text = text_config(config)
    topk, pool = getattr(text, "index_topk", None), getattr(text, "index_kpool", None)
    # a query at position p sees (p + 1) // pool complete pools: all of them are selected while p + 1 < (K + 1) pool
    return None if topk is None or pool is None else (topk // pool + 1) * pool - 1


def pads_shift_positions(config) -> bool:
    """Whether a left pad moves a row's tokens to other positions in what the model computes: Inkling's log-scaled
    attention (`log_scaling_n_floor`) scales each query by its position counted in cache columns, pads included
    (modeling_inkling.py InklingAttention.forward: get_query_offset, then tau of q_positions)."""
    text = text_config(config)
    return getattr(text, "model_type", None) == "inkling_text" and text.log_scaling_n_floor is not None


def fresh_states(config) -> dict[tuple[int, int], int]:
    """{(layer, state index): value} of the conv states that start at that value, not 0, in a fresh sequence."""
    family = family_of(config)
    return family.fresh_states(text_config(config)) if family.fresh_states is not None else {}


def spec_from_config(config, dtype: torch.dtype | str | None = None) -> cm.ModelSpec:
    """ModelSpec of a transformers config (multimodal configs use their text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = (getattr(text, "model_type", None) or "").removesuffix("_text")
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}")
    reader = READERS.get(model_type)
    if reader is None:
        raise UnsupportedModelError(
            f"model_type {getattr(text, 'model_type', None)!r} ({type(config).__name__}) is not supported by the cost "
            f"model; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    dtype_bytes = rd.dtype_bytes_of(text, dtype)
    groups = tuple(g for g in reader(text, dtype_bytes) if g.count > 0)
    return cm.ModelSpec(model_type, text.hidden_size, dtype_bytes, groups, reuse_limit=selection_limit(config))
