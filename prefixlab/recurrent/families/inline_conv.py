"""Inkling's short convolutions (InklingShortConvolution; Inkling2's, whose key / value convs add per-token taps
projected from the layer input, Inkling2DynamicShortConvolution): four per decoder layer, on the attention's keys
and values and on the attention and MLP outputs, each a causal conv over K tokens with a residual, computed in
fp32. Each keeps one conv state, the last K inputs (fp32), in its own slot (`state_idx` = its `conv_idx`) of the
layer's hybrid cache layer; there is no recurrent state.

The conv itself runs as transformers' own forward (bit-identical, cache writes included); the patch only records
the states at the offsets the cache asks for: the last K masked inputs before each offset, from the cached state
and this forward's inputs, read before the forward writes the cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixlab.recurrent.families.base import LayerCache, mask_padding, original_forward, padding_mask


class InlineShortConv:
    classes: tuple[str, ...] = ("InklingShortConvolution", "Inkling2ShortConvolution",
                                "Inkling2DynamicShortConvolution")
    has_recurrent_state = False
    read_directly: tuple[str, ...] = ()  # (its own forward runs; it reads conv1d under accelerate hooks itself)

    def run(self, layer: nn.Module, hidden_states: torch.Tensor, *inputs: Any, past_key_values: Any = None,
            conv_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        """The layer's output, as its own forward computes it, after recording the requested states. `inputs`:
        what else the layer takes (Inkling2's dynamic convs: the input of their per-token weights)."""
        cache = past_key_values
        batch, length = hidden_states.shape[:2]
        view = LayerCache(cache, layer.layer_idx, batch, length, has_recurrent_state=False,
                          state_idx=layer.conv_idx)
        if view.positions:
            k = layer.conv_kernel_size
            conv_input = mask_padding(hidden_states.float(), padding_mask(conv_mask, hidden_states)).transpose(1, 2)
            history = view.conv_state  # (a recorded past is the whole history: the state is its last k)
            history = conv_input.new_zeros(batch, conv_input.shape[1], k) if history is None else history[..., -k:]
            full = torch.cat([F.pad(history, (k - history.shape[-1], 0)), conv_input], dim=-1)
            view.record({o: full[..., o : o + k].clone() for o in view.positions}, {}, None)
        return original_forward(layer)(hidden_states, *inputs, past_key_values=cache, conv_mask=conv_mask, **kwargs)
