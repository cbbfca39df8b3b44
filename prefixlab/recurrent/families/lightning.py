"""MiniMax's lightning attention (MiniMaxLightningAttention): a linear attention whose state, per head, is the
decayed sum S_t = e^-s S_{t-1} + k_t^T v_t (a constant decay rate s per head), read as o_t = q_t S_t. There is no
conv and no conv state. transformers keeps S in MiniMaxCache's own `linear_cache` list (modeling_minimax.py:199,
:269), which prefixlab's MiniMax cache maps onto the recurrent state of the layer's cache layer (cache/hf_minimax.py).

transformers computes a prefill from zeros block by block (modeling_minimax.py:204-239) and continues a cached state
token by token (:241-253), the same sum in another order (equal up to rounding). This forward runs the block path
from any state, in segments that end at the capture offsets, so the state there is recorded in the one pass; a
forward from zeros without captures runs exactly transformers' ops, a one-token forward over a cached state its
token step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixlab.recurrent.families.base import LayerCache, mask_padding, padding_mask


class LightningAttention:
    classes: tuple[str, ...] = ("MiniMaxLightningAttention",)
    has_recurrent_state = True
    has_conv_state = False
    read_directly: tuple[str, ...] = ()  # every child is called as a module

    def run(self, layer: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
            attention_mask: Any = None, past_key_values: Any = None, **kwargs: Any,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, final state) as MiniMaxLightningAttention.forward returns them, the states at the offsets the
        cache asks for recorded, the final one written through the cache's set_linear_cache as transformers does."""
        cache = past_key_values
        batch, length = hidden_states.shape[:2]
        heads, head_dim = layer.num_attention_heads, layer.head_dim
        # (read through MiniMaxCache's own interface: the patched layer also serves transformers' MiniMaxCache)
        view = LayerCache(cache, layer.layer_idx, batch, length, has_recurrent_state=False, has_conv_state=False)
        state = cache.get_linear_cache(layer.layer_idx) if cache is not None else None
        qkv = layer.act_fn(layer.qkv_proj(hidden_states))
        qkv = mask_padding(qkv, padding_mask(attention_mask, hidden_states))
        query, key, value = (t.transpose(1, 2) for t in
                             torch.split(qkv.reshape(batch, length, heads, 3 * head_dim), head_dim, dim=3))
        if state is not None and length == 1:  # transformers' token step (:241-253)
            before, state = state, torch.exp(-layer.slope_rate) * state + torch.matmul(key.transpose(-1, -2), value)
            output = torch.matmul(query, state)
            states = {o: s.clone() for o, s in ((0, before), (1, state)) if o in view.positions}
        else:
            if state is None:
                state = value.new_zeros(batch, heads, head_dim, head_dim)
            output, state, states = _blocks(layer, query, key, value, state, view.positions)
        view.record({}, states, state.dtype)

        output = output.transpose(1, 2).reshape(batch, length, heads * head_dim)
        output = F.sigmoid(layer.output_gate(hidden_states)) * layer.norm(output)
        output = layer.out_proj(output)
        if cache is not None:
            cache.set_linear_cache(layer.layer_idx, state)
        return output, state


def _blocks(layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: torch.Tensor,
            capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' block path (modeling_minimax.py:204-239) from `state`, its blocks of `block_size` also split at
    the capture offsets: (outputs [B, H, T, d], final state, {offset: state after that many tokens})."""
    length = query.shape[2]
    bounds = sorted({*range(0, length, layer.block_size), *capture, length} - {0})
    states = {0: state.clone()} if 0 in capture else {}
    outputs, start = [], 0
    for stop in bounds:
        size = stop - start
        q, k, v = query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * layer.diagonal_decay[:, :, :size, :size], v)
        outputs.append(torch.matmul(q * layer.query_decay[:, :size], state) + intra)
        state = state * torch.exp(-layer.slope_rate * size) + torch.matmul(
            (k * layer.key_decay[:, -size:]).transpose(-1, -2), v)
        if stop in capture:
            states[stop] = state.clone()
        start = stop
    return torch.cat(outputs, dim=-2), state, states
