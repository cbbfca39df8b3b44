"""ZAYA's compressed convolutional attention projection (ZayaCCAProjection): q | k through two causal convs (a
depthwise one, then one grouped by head) plus residual paths, v half from the current token and half from the
previous one ("delayed"). It is an attention layer's projection, not a linear-attention mixer, so it has its own
`run` instead of `run_layer`'s project / mix / finish steps; what it shares with them is the cache protocol
(`LayerCache`: the cached states in, the capture offsets, the records out).

Its state after the first o tokens of a forward: the conv state, the last K = (cca_time0 - 1) + (cca_time1 - 1)
q | k projections (zeros before the first token), and the recurrent state, token o - 1's delayed V projection.
transformers' layer (modeling_zaya.py, ZayaCCAProjection.forward) resumes from both exactly; this forward computes
the same tensors with the same modules and records the states at the offsets the cache asks for."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixlab.recurrent.families.base import LayerCache, mask_padding, padding_mask


class ZayaCCA:
    classes: tuple[str, ...] = ("ZayaCCAProjection",)
    has_recurrent_state = True
    read_directly: tuple[str, ...] = ()  # every child is called as a module
    # children whose bias reaches the conv state from a (zeroed) padded position: model_info.pads_change_states
    # (v_proj_delayed's bias does not: a pad's delayed V equals the one a first token starts from)
    pad_projections: tuple[str, ...] = ("q_proj", "k_proj")

    def run(self, layer: nn.Module, hidden_states: torch.Tensor, cache: Any = None, conv_mask: Any = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query, key, value) [B, T, heads, head_dim] as ZayaCCAProjection.forward returns them, the states
        recorded and written to `cache` as the module docstring says."""
        hidden_states = mask_padding(hidden_states, padding_mask(conv_mask, hidden_states))
        batch, length = hidden_states.shape[:2]
        view = LayerCache(cache, layer.layer_idx, batch, length, has_recurrent_state=True)
        k = layer.conv_kernel_size
        hidden_shape = (batch, length, -1, layer.head_dim)

        queries, keys = layer.q_proj(hidden_states), layer.k_proj(hidden_states)
        query_residual = queries.view(*hidden_shape)
        key_residual = keys.view(*hidden_shape).repeat_interleave(layer.num_key_value_groups, dim=2)
        query_residual = (query_residual + key_residual) * 0.5
        key_residual = query_residual.view(batch, length, -1, layer.num_key_value_groups, layer.head_dim).mean(-2)

        qk_states = torch.cat([queries, keys], dim=-1).transpose(1, 2)
        history = view.conv_state  # (a recorded past is the whole history: the conv needs its last k)
        if history is None:
            qk_states = F.pad(qk_states, (k, 0))
        else:
            history = history[..., -k:]
            qk_states = torch.cat([F.pad(history, (k - history.shape[-1], 0)), qk_states], dim=-1)
        mixed = layer.conv_qk_grouped(layer.conv_qk_depthwise(qk_states)).transpose(1, 2)
        query_size = query_residual.shape[-2] * query_residual.shape[-1]
        query = mixed[..., :query_size].view(*hidden_shape) + query_residual
        key = mixed[..., query_size:].view(*hidden_shape) + key_residual

        delayed = layer.v_proj_delayed(hidden_states)
        previous = view.recurrent_state  # token -1's delayed V: the cached one, else that of a zero input
        previous = (layer.v_proj_delayed(hidden_states.new_zeros(batch, 1, layer.hidden_size))
                    if previous is None else previous.unsqueeze(1))
        value_delayed = torch.cat([previous, delayed[:, :-1]], dim=1)
        value = torch.cat([layer.v_proj_current(hidden_states), value_delayed], dim=-1).view(*hidden_shape)

        if view.positions:
            conv_states = {o: qk_states[..., o : o + k].clone() for o in view.positions}
            recurrent = {o: (previous[:, 0] if o == 0 else delayed[:, o - 1]).clone() for o in view.positions}
            view.record(conv_states, recurrent, view.recurrent_dtype(delayed))
        if cache is not None:  # what transformers' layer writes
            cache.update_conv_state(qk_states[..., -k:], layer.layer_idx)
            cache.update_recurrent_state(delayed[:, -1, :], layer.layer_idx)
        return query, key, value
