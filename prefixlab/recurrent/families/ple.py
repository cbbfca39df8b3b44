"""Qwen4-Exp's per-layer embeddings (PLE): two more states in the cache layer of a GatedDeltaNet layer.

A PLE layer keeps state 1, the last (K - 1) * dilation inputs of its dilated depthwise conv (zeros before the first
token), and state 2, its n-gram context: the last `ngram_size - 1` token ids (eos before the first). transformers'
own code already continues both from the cache for any number of new tokens, so patching leaves the computation
alone: it wraps the two methods that read and write them (the PLE layer's `_short_conv`, its n-gram embedding's
`forward`) to hand the cache the states at the capture offsets first (capture protocol: families/base.py, with the
state's index: `cache.prefixlab_record(layer_idx, offset, state, None, state_idx=i[, row=b])`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prefixlab.recurrent.families.base import CAPTURE_ATTRIBUTE, capture_rows, owned


def record_history(cache: Any, layer_idx: int, state_idx: int, history: torch.Tensor, width: int) -> None:
    """Hand `cache` the state after each capture offset o of a forward whose state history (the `width` entries
    before it, then its own, along the last axis) is `history`: entries o .. o + width - 1."""
    positions = getattr(cache, CAPTURE_ATTRIBUTE, None)
    if positions is None:
        return
    for row, offsets in capture_rows(positions, history.shape[0], history.shape[-1] - width).items():
        extra = {} if row is None else {"row": row}
        for offset in offsets:
            state = history[..., offset : offset + width]
            cache.prefixlab_record(layer_idx, offset, state.clone() if row is None else owned(state, row), None,
                                   state_idx=state_idx, **extra)


def _previous(cache: Any, layer_idx: int, state_idx: int, width: int) -> torch.Tensor | None:
    state = cache.get_conv_state(layer_idx, state_idx=state_idx)
    return None if state is None else state[..., -width:]  # (the whole history while the cache records the past)


class PerLayerEmbeddingConv:
    """The PLE layer's dilated conv: its `_short_conv(hidden_states [B, T, C], cache)` reads and writes state 1."""

    classes: tuple[str, ...] = ("Qwen4ExpTextPLELayer",)
    attribute = "_short_conv"
    state_idx = 1

    def record(self, layer: nn.Module, hidden_states: torch.Tensor, cache: Any) -> None:
        width, x = layer.short_conv_state_len, hidden_states.transpose(1, 2)
        before = _previous(cache, layer.layer_idx, self.state_idx, width)
        before = x.new_zeros(*x.shape[:2], width) if before is None else before.to(x.dtype)
        record_history(cache, layer.layer_idx, self.state_idx, torch.cat([before, x], dim=-1), width)


class NGramContext:
    """The PLE layer's n-gram embedding: its `forward(input_ids [B, T], cache)` reads and writes state 2."""

    classes: tuple[str, ...] = ("Qwen4ExpTextNGramEmbedding",)
    attribute = "forward"
    state_idx = 2

    def record(self, layer: nn.Module, input_ids: torch.Tensor, cache: Any) -> None:
        width, ids = layer.context_len, input_ids.long()
        before = _previous(cache, layer.layer_idx, self.state_idx, width)
        before = ids.new_full((ids.shape[0], width), layer.eos_token_id) if before is None else before
        record_history(cache, layer.layer_idx, self.state_idx, torch.cat([before, ids], dim=-1), width)
