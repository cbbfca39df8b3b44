"""Inkling's short convolutions (InklingShortConvolution): four per decoder layer, on the attention's keys and
values and on the attention and MLP outputs, each a depthwise causal conv with a residual, computed in fp32. Each
keeps one conv state, the last K inputs (fp32), in its own slot (`state_idx` = its `conv_idx`) of the layer's
hybrid cache layer; there is no recurrent state.

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
    classes: tuple[str, ...] = ("InklingShortConvolution",)
    has_recurrent_state = False
    read_directly: tuple[str, ...] = ()  # (its own forward runs; it reads conv1d under accelerate hooks itself)

    def run(self, layer: nn.Module, hidden_states: torch.Tensor, cache: Any, conv_mask: Any,
            backend: str) -> torch.Tensor:
        """The layer's output, as its own forward computes it, after recording the requested states."""
        batch, length = hidden_states.shape[:2]
        view = LayerCache(cache, layer.layer_idx, batch, length, has_recurrent_state=False,
                          state_idx=layer.conv_idx)
        if view.positions:
            k = layer.conv_kernel_size
            inputs = mask_padding(hidden_states.float(), padding_mask(conv_mask, hidden_states)).transpose(1, 2)
            history = view.conv_state  # (a recorded past is the whole history: the state is its last k)
            history = inputs.new_zeros(batch, inputs.shape[1], k) if history is None else history[..., -k:]
            full = torch.cat([F.pad(history, (k - history.shape[-1], 0)), inputs], dim=-1)
            view.record({o: full[..., o : o + k].clone() for o in view.positions}, {}, None)
        return original_forward(layer)(hidden_states, past_key_values=cache, conv_mask=conv_mask)
