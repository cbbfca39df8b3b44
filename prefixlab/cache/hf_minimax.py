"""The cache classes a model takes: HybridPrefixCache and DynamicCache, or, for MiniMax, subclasses that are also
MiniMaxCache. MiniMaxModel.forward refuses any cache that is not a MiniMaxCache (transformers 5.23
modeling_minimax.py:652), whose lightning-attention layers read and write their state through
`get_linear_cache` / `set_linear_cache` (:199, :269) into a list of its own. These classes keep that state in the
recurrent state of the layer's cache layer instead, where prefixlab checkpoints and restores every recurrent state."""

from __future__ import annotations

from functools import cache

import torch
from transformers.cache_utils import DynamicCache

from prefixlab.cache.hfspec import model_type_of


def cache_class(config) -> type:
    """The HybridPrefixCache class serving a model of this config."""
    from prefixlab.cache.hf import HybridPrefixCache

    return _minimax_prefix_cache() if model_type_of(config) == "minimax" else HybridPrefixCache


def dynamic_cache(config) -> DynamicCache:
    """A DynamicCache for a model of this config (a MiniMaxCache for MiniMax, its states on the cache layers)."""
    return (_minimax_dynamic_cache() if model_type_of(config) == "minimax" else DynamicCache)(config=config)


@cache
def _minimax_dynamic_cache() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class MiniMaxLayeredCache(MiniMaxCache):
        """MiniMaxCache's interface over the cache layers' recurrent states (its own list is never built)."""

        def __init__(self, *args, **kwargs):
            super(MiniMaxCache, self).__init__(*args, **kwargs)  # (DynamicCache's, by config: linear layers too)

        __len__ = DynamicCache.__len__

        def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
            self.update_recurrent_state(linear_cache, layer_idx)

        # (MiniMaxCache's own edit its list; the cache layers edit their states themselves)
        batch_repeat_interleave = DynamicCache.batch_repeat_interleave
        batch_select_indices = DynamicCache.batch_select_indices

    return MiniMaxLayeredCache


@cache
def _minimax_prefix_cache() -> type:
    from prefixlab.cache.hf import HybridPrefixCache

    class MiniMaxPrefixCache(HybridPrefixCache, _minimax_dynamic_cache()):
        """HybridPrefixCache for MiniMax models (see the module docstring)."""

        def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
            self._require_driven()  # (as get_conv_state: only in a forward the store's hooks announced)
            return super().get_linear_cache(layer_idx)

    return MiniMaxPrefixCache
