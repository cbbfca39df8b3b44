"""A transformers Cache that stores KV shared by several sequences ONCE, for `attn_implementation="hydragen"`.

    cache = HydragenCache(model.config)
    model.generate(prompt, num_return_sequences=64, past_key_values=cache, ...)

Each full-attention layer holds a tree of `SharedLevel`s (one copy, no batch dimension) plus every sequence's own
suffix (B, kv_heads, S, D). Shared KV comes from two places:
- `load_shared_prefix(...)`: KV (and recurrent states) of a prefix computed elsewhere, e.g. by a prefix store;
- while a layer has no per-sequence suffix yet (the prefill), the tokens whose KV is bit-identical across the batch
  (all rows: a common prefix; groups of identical rows: each `num_return_sequences` group) become shared levels.
`update` hands the attention a `SharedBatchKV` that `prefixlab.attention.hf` runs through Hydragen. Recurrent and
other layer types keep transformers' own per-sequence cache layers: only attention KV is shared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from prefixlab.attention.dedupe import common_prefix_length, identical_row_groups
from prefixlab.attention.prefix_checks import check_prefix
from prefixlab.attention.reference import materialize_rows
from prefixlab.attention.tree import SharedLevel
from prefixlab.cache.hfspec import keeps_recurrent_state
from prefixlab.errors import InvalidInputError

# transformers' own implementations expect (B, H, T, D) tensors, not a SharedBatchKV
BUILTIN_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True)
class SharedBatchKV:
    """What a `SharedPrefixLayer` gives the attention in place of (B, H, T, D) keys and values."""

    levels: tuple[SharedLevel, ...]
    seq_levels: torch.Tensor  # (B,) int64, deepest level of each sequence
    suffix_keys: torch.Tensor  # (B, kv_heads, S, D)
    suffix_values: torch.Tensor
    prefix_length: int  # shared tokens before every sequence's suffix (equal for all rows)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's full (B, kv_heads, prefix + S, D) keys and values, as a standard cache holds them."""
        rows = materialize_rows(self.levels, self.seq_levels.tolist(), self.suffix_keys, self.suffix_values)
        return torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])


class SharedPrefixLayer(CacheLayerMixin):
    """Cache layer for one attention layer: shared levels stored once, per-sequence suffix in `keys`/`values`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, share_new_tokens: bool = True, **kwargs):
        super().__init__()
        self.share_new_tokens = share_new_tokens
        self.levels: list[SharedLevel] = []
        self.seq_levels: torch.Tensor | None = None  # known once the batch size is
        self.prefix_length = 0
        self.expected_batch: int | None = None  # set by load_levels

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_batch(self.expected_batch, key_states.shape[0])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        if self.seq_levels is None:
            self.seq_levels = torch.full((key_states.shape[0],), len(self.levels) - 1, dtype=torch.int64)
        self.is_initialized = True

    def load_levels(self, keys: torch.Tensor, values: torch.Tensor, batch_size: int) -> None:
        """Make (kv_heads, P, D) keys/values the shared prefix of every sequence (before any token is cached)."""
        if self.is_initialized or self.levels:
            raise InvalidInputError("load_shared_prefix must be called on an empty cache, before generate/forward")
        self.levels = [SharedLevel(keys, values)] if keys.shape[1] else []
        self.prefix_length = keys.shape[1]
        self.expected_batch = batch_size

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise InvalidInputError(
                f"the cache holds {self.keys.shape[0]} sequences but got keys for {key_states.shape[0]}; "
                "use one HydragenCache per batch (load_shared_prefix(batch_size=...) must match the batch)"
            )
        suffix_keys = torch.cat([self.keys, key_states], dim=-2)
        suffix_values = torch.cat([self.values, value_states], dim=-2)
        # a snapshot: `_absorb` below edits the tree for the NEXT step, this step attends over the current one
        view = SharedBatchKV(tuple(self.levels), self.seq_levels.clone(), suffix_keys, suffix_values,
                             self.prefix_length)
        if self.keys.shape[-2] == 0 and self.share_new_tokens and self._one_leaf() and key_states.shape[0] > 1:
            self._absorb(key_states, value_states)
        else:
            self.keys, self.values = suffix_keys, suffix_values
        if not view.levels:  # nothing shared yet: plain tensors, so attention runs exactly as with DynamicCache
            return suffix_keys, suffix_values
        return view, view

    def _one_leaf(self) -> bool:
        return bool((self.seq_levels == self.seq_levels[0]).all())

    def _add_level(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Store (kv_heads, L, D) once below the rows' current leaf (extending it when every row shares it)."""
        leaf = int(self.seq_levels[0]) if rows is None else int(self.seq_levels[rows[0]])
        if rows is None and leaf >= 0:
            old = self.levels[leaf]
            extended = torch.cat([old.keys, keys], 1), torch.cat([old.values, values], 1)
            self.levels[leaf] = SharedLevel(*extended, old.parent)
            return
        self.levels.append(SharedLevel(keys, values, None if leaf < 0 else leaf))
        if rows is None:
            self.seq_levels.fill_(len(self.levels) - 1)
        else:
            self.seq_levels[rows] = len(self.levels) - 1

    def _absorb(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Move new tokens shared across rows into levels; keep the rest as the suffix (equal length for all rows)."""
        common = common_prefix_length(key_states, value_states)
        if common:
            self._add_level(key_states[0, :, :common].clone(), value_states[0, :, :common].clone(), None)
        rest_keys, rest_values = key_states[:, :, common:], value_states[:, :, common:]
        groups = identical_row_groups(rest_keys, rest_values) if rest_keys.shape[-2] else []
        if groups and len(groups) < key_states.shape[0] and min(rows.numel() for rows in groups) > 1:
            for rows in groups:
                self._add_level(rest_keys[rows[0]].clone(), rest_values[rows[0]].clone(), rows.cpu())
            rest_keys, rest_values = rest_keys[:, :, :0], rest_values[:, :, :0]
        self.prefix_length += key_states.shape[-2] - rest_keys.shape[-2]
        self.keys, self.values = rest_keys.contiguous(), rest_values.contiguous()

    def join(self, rows: Sequence[SharedPrefixLayer]) -> None:
        """Become the batch of batch-1 `rows` that hold the same levels: their suffixes left-padded with zeros."""
        levels = rows[0].levels
        if not levels or any(len(r.levels) != len(levels) or r.prefix_length != rows[0].prefix_length or
                             any(a.keys is not b.keys or a.values is not b.values
                                 for a, b in zip(r.levels, levels, strict=True)) for r in rows):
            raise InvalidInputError("join_rows: the rows must share the same loaded levels (one load_shared_prefix "
                                    "source)")
        heads, _, dim = levels[0].keys.shape
        empty = levels[0].keys.new_zeros(1, heads, 0, dim)
        suffixes = [(r.keys, r.values) if r.is_initialized else (empty, empty) for r in rows]
        width = max(k.shape[-2] for k, _ in suffixes)

        def padded(side: int) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(kv[side], (0, 0, width - kv[side].shape[-2], 0))
                              for kv in suffixes])

        self.levels, self.prefix_length, self.expected_batch = list(levels), rows[0].prefix_length, len(rows)
        self.dtype, self.device = empty.dtype, empty.device
        self.keys, self.values = padded(0), padded(1)
        self.seq_levels = torch.full((len(rows),), len(levels) - 1, dtype=torch.int64)
        self.is_initialized = True

    # -- sizes -------------------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.prefix_length + (self.keys.shape[-2] if self.is_initialized else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def shared_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for level in self.levels for t in (level.keys, level.values))

    def per_sequence_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    # -- batch edits: the shared levels never move, only the per-sequence rows -----------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows.to(self.keys.device))
            self.values = self.values.index_select(0, rows.to(self.values.device))
            self.seq_levels = self.seq_levels.index_select(0, rows.cpu())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise InvalidInputError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if -tokens_to_remove > self.keys.shape[-2]:
            raise InvalidInputError(
                f"crop({tokens_to_remove}) would cut into the shared prefix; only the {self.keys.shape[-2]} "
                "per-sequence tokens can be removed"
            )
        self.keys, self.values = self.keys[..., :tokens_to_remove, :], self.values[..., :tokens_to_remove, :]

    def reset(self) -> None:
        self.keys = self.values = None
        self.levels, self.seq_levels, self.prefix_length, self.expected_batch = [], None, 0, None
        self.is_initialized = False


class HydragenCache(Cache):
    """Cache for `attn_implementation="hydragen"`: attention KV shared by sequences is stored once.

    Args:
        config: the model config (its layer types pick the cache layer of each layer).
        share_new_tokens: detect KV identical across the batch at prefill and store it once (default True).
    """

    def __init__(self, config, share_new_tokens: bool = True):
        implementation = getattr(config, "_attn_implementation", None)
        if implementation in BUILTIN_ATTENTION:
            raise InvalidInputError(
                f"the model uses attn_implementation={implementation!r}, which cannot read shared KV: call "
                "model.set_attn_implementation('hydragen') (import prefixlab.attention) before building HydragenCache"
            )
        text_config = config.get_text_config(decoder=True)
        if getattr(text_config, "attn_logit_softcapping", None) is not None:  # Gemma 2
            raise InvalidInputError(
                f"{text_config.model_type} caps its attention scores (attn_logit_softcapping), which hydragen "
                "attention's plain softmax does not: use HybridPrefixCache (or DynamicCache) for this model"
            )
        if getattr(text_config, "kv_lora_rank", None) is not None:  # Kimi Linear, DeepSeek V2/V3
            raise InvalidInputError(
                f"{text_config.model_type} uses multi-head latent attention: its cache holds compressed latents that "
                "each layer expands before attending, so HydragenCache cannot hand it shared KV; use "
                "HybridPrefixCache (or DynamicCache) for this model"
            )
        if "indexed_attention" in (getattr(text_config, "layer_types", None) or ()):  # Qwen4-Exp
            raise InvalidInputError(
                f"{text_config.model_type} attends through a token indexer (QSA: each query's own mask over its "
                "cached keys), which hydragen attention over shared KV does not compute; use HybridPrefixCache (or "
                "DynamicCache) for this model"
            )
        if text_config.model_type == "minimax":
            raise InvalidInputError(
                "minimax's model takes no cache but its own MiniMaxCache (transformers modeling_minimax.py, "
                "MiniMaxModel.forward), which HydragenCache is not; use HybridPrefixCache(store) for this model"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            SharedPrefixLayer(share_new_tokens) if kind == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
            for kind, kw in zip(layer_types, layer_kwargs, strict=True)
        ]
        super().__init__(layers=layers)
        self.expected_batch: int | None = None  # set by load_shared_prefix
        self.loaded_as: set = set()  # (dtype, device) of what load_shared_prefix loaded, until the first forward
        self.text_config = text_config  # (load_shared_prefix reads its layer shapes)
        self.keeps_recurrent_state = keeps_recurrent_state(text_config)  # else conv states only (LFM2)

    def reset(self) -> None:
        super().reset()
        self.expected_batch, self.loaded_as = None, set()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_loaded_as(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        # recurrent layers run before the first attention layer: check the batch here for a clear error
        _check_batch(self.expected_batch, conv_states.shape[0])
        self._check_loaded_as(conv_states)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def _check_loaded_as(self, computed: torch.Tensor) -> None:
        """At the first layer of the first forward after a load (before it changes the cache): the loaded prefix
        must be in the dtype the model computes in, and on its device where it is all on one (a load alone cannot
        know them). Every family whose prefix it loads keeps its conv states in its KV's dtype (not Inkling's fp32
        conv states, whose layers hold KV and state together: no shared level to load)."""
        dtypes, devices = {dtype for dtype, _ in self.loaded_as}, {device for _, device in self.loaded_as}
        if dtypes - {computed.dtype} or (len(devices) == 1 and devices != {computed.device}):
            loaded = ", ".join(sorted(f"{dtype} on {device}" for dtype, device in self.loaded_as))
            raise InvalidInputError(
                f"the shared prefix was loaded as {loaded} but the model computes in {computed.dtype} on "
                f"{computed.device}: reset() the cache and load_shared_prefix the tensors in the model's dtype and "
                "device"
            )
        self.loaded_as = set()

    def shared_bytes(self) -> int:
        """Bytes of attention KV stored once for several sequences."""
        return sum(layer.shared_bytes() for layer in self.layers if isinstance(layer, SharedPrefixLayer))

    def per_sequence_bytes(self) -> int:
        """Bytes of attention KV stored per sequence (the suffixes)."""
        return sum(layer.per_sequence_bytes() for layer in self.layers if isinstance(layer, SharedPrefixLayer))

    def load_shared_prefix(
        self,
        keys: Mapping[int, torch.Tensor] | Sequence[torch.Tensor | None],
        values: Mapping[int, torch.Tensor] | Sequence[torch.Tensor | None],
        batch_size: int,
        conv_states: Mapping[int, torch.Tensor] | None = None,
        recurrent_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Feed a prefix computed elsewhere (e.g. a prefix store hit) as the level every sequence shares.

        Args:
            keys, values: per attention layer index, (1, kv_heads, P, D) or (kv_heads, P, D); stored once.
            batch_size: sequences that will continue from the prefix (the batch `generate` will run).
            conv_states, recurrent_states: per linear-attention layer, the state after the prefix for one sequence
                (batch 1) or each (batch_size); copied per sequence because recurrent layers run per sequence. A model
                whose linear-attention layers keep only a conv state (LFM2) takes no recurrent_states.
        Then call `generate` with input_ids that START with the prefix tokens: it feeds only the tokens after it.
        """
        attention = [i for i, layer in enumerate(self.layers) if isinstance(layer, SharedPrefixLayer)]
        recurrent = [i for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        shaped, per_sequence = check_prefix(self.text_config, attention, recurrent, self.keeps_recurrent_state, keys,
                                            values, batch_size, conv_states, recurrent_states)
        if any(self.layers[i].is_initialized or self.layers[i].levels for i in attention):
            raise InvalidInputError("load_shared_prefix must be called on an empty cache, before generate/forward")
        # (all checked before any layer changes: a refused load leaves the cache empty)
        loaded = [k for k, _ in shaped.values() if k.shape[1]] + [conv for conv, _ in per_sequence.values()]
        self.loaded_as = {(t.dtype, t.device) for t in loaded}
        self.expected_batch = batch_size = int(batch_size)
        for i, (k, v) in shaped.items():
            self.layers[i].load_levels(k, v, batch_size)
        for i, (conv, recurrent_state) in per_sequence.items():
            _set_state(self.layers[i], conv, recurrent_state)

    @classmethod
    def join_rows(cls, config, rows: Sequence[HydragenCache]) -> HydragenCache:
        """One cache for the batch of `rows`: batch-1 caches loaded with the SAME shared levels (load_shared_prefix
        with the same tensors), then each fed its own tokens. The levels are kept once; each row's suffix KV is
        left-padded with zeros to the longest (generate must mask it: attention_mask [prefix | 0.. | row's tokens])
        and its recurrent + conv states are its own, computed without padding. Attention and linear-attention layers
        only; every recurrent layer must hold a state."""
        joined = cls(config)
        if not rows or any(not isinstance(row, HydragenCache) or row.expected_batch not in (None, 1) for row in rows):
            raise InvalidInputError("join_rows takes batch-1 HydragenCaches (load_shared_prefix(batch_size=1))")
        for i, layer in enumerate(joined.layers):
            parts = [row.layers[i] for row in rows]
            if isinstance(layer, SharedPrefixLayer):
                layer.join(parts)
            elif type(layer) is LinearAttentionLayer and all(p.has_previous_state[0] for p in parts):
                _set_state(layer, torch.cat([p.conv_states[0] for p in parts]),
                           torch.cat([p.recurrent_states[0] for p in parts]) if joined.keeps_recurrent_state else None)
            else:
                raise InvalidInputError(f"join_rows: layer {i} ({type(layer).__name__}) has no state in every row or "
                                        "is a kind it cannot join")
        joined.expected_batch = len(rows)
        return joined


def _set_state(layer: LinearAttentionLayer, conv: torch.Tensor, recurrent: torch.Tensor | None) -> None:
    """Give a linear-attention cache layer (batch, ...) conv and recurrent states (None: it keeps none), as after a
    prefill."""
    # both buffers allocated anew at this batch (after reset() transformers keeps the old recurrent one)
    layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent, conv_kernel_size=conv.shape[-1])
    layer.conv_states[0].copy_(conv)
    if recurrent is not None:
        layer.update_recurrent_state(recurrent)
    layer.has_previous_state[0] = True


def _check_batch(expected: int | None, batch: int) -> None:
    if expected not in (None, batch):
        raise InvalidInputError(
            f"load_shared_prefix(batch_size={expected}) but generate runs {batch} sequences; "
            "pass the batch generate will run (prompts x num_return_sequences)"
        )
