"""Layer families prefixlab.recurrent.patch knows, by the transformers class names of their layers."""

from __future__ import annotations

from torch import nn

from prefixlab.recurrent.families.base import Family
from prefixlab.recurrent.families.cca import ZayaCCA
from prefixlab.recurrent.families.gated_delta import (
    BailingHybridDeltaAttention,
    GatedDeltaNet,
    KimiDeltaAttention,
    OlmoHybridGatedDeltaNet,
    Qwen3NextGatedDeltaNet,
)
from prefixlab.recurrent.families.inline_conv import InlineShortConv
from prefixlab.recurrent.families.lightning import LightningAttention
from prefixlab.recurrent.families.mamba1 import MambaMixer, MultiHeadMambaMixer, NormalisedMambaMixer
from prefixlab.recurrent.families.mamba2 import FalconH1Mixer, Mamba2Mixer
from prefixlab.recurrent.families.ple import NGramContext, PerLayerEmbeddingConv
from prefixlab.recurrent.families.short_conv import ShortConv

FAMILIES: tuple[Family, ...] = (
    GatedDeltaNet(),
    Qwen3NextGatedDeltaNet(),
    OlmoHybridGatedDeltaNet(),
    KimiDeltaAttention(),
    BailingHybridDeltaAttention(),
    Mamba2Mixer(),
    FalconH1Mixer(),
    MambaMixer(),
    NormalisedMambaMixer(),
    MultiHeadMambaMixer(),
    ShortConv(),
    ZayaCCA(),
    InlineShortConv(),
    LightningAttention(),
)
_BY_CLASS_NAME = {name: family for family in FAMILIES for name in family.classes}

SUPPORTED_CLASSES: tuple[str, ...] = tuple(sorted(_BY_CLASS_NAME))

# Other layers that keep states in a linear-attention cache layer, computed exactly by transformers' own code: patched
# only to record those states at the capture offsets (families/ple.py).
RECORDERS = (PerLayerEmbeddingConv(), NGramContext())
_RECORDER_BY_CLASS_NAME = {name: recorder for recorder in RECORDERS for name in recorder.classes}


def family_of(layer: nn.Module) -> Family | None:
    """The family serving this layer: its class must be transformers' own (not remote code that reuses a name)."""
    cls = type(layer)
    if not cls.__module__.startswith("transformers.models."):
        return None
    return _BY_CLASS_NAME.get(cls.__name__)


def recorder_of(layer: nn.Module):
    """The recorder of this layer's extra states (RECORDERS), for transformers' own classes only; else None."""
    cls = type(layer)
    return _RECORDER_BY_CLASS_NAME.get(cls.__name__) if cls.__module__.startswith("transformers.models.") else None


__all__ = ["FAMILIES", "RECORDERS", "SUPPORTED_CLASSES", "Family", "family_of", "recorder_of"]
