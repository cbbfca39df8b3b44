"""`attn_implementation="hydragen"` for transformers models: Hydragen over a `HydragenCache`, SDPA otherwise.

Importing prefixlab.attention registers it. With any other cache (or none) the keys and values are plain tensors and
the implementation IS transformers' SDPA one, masks included; with a `HydragenCache` the attention layers receive a
`SharedBatchKV` and run `hydragen_attention` over the shared levels + per-sequence suffixes.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from prefixlab.attention.api import hydragen_attention
from prefixlab.attention.hf_cache import SharedBatchKV
from prefixlab.errors import InvalidInputError

NAME = "hydragen"


def _suffix_mask(attention_mask: torch.Tensor | None, kv: SharedBatchKV, queries: int) -> torch.Tensor | None | bool:
    """The (B, Tq, S) suffix visibility from transformers' 4D SDPA mask, or False when a shared column is masked."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.ndim != 4:
        raise InvalidInputError(
            f"hydragen attention got a {attention_mask.dtype} mask of shape {tuple(attention_mask.shape)}; "
            "it expects transformers' boolean SDPA mask (keep the default mask interface for 'hydragen')"
        )
    batch, slots = kv.suffix_keys.shape[0], kv.suffix_keys.shape[2]
    mask = attention_mask[:, 0, -queries:, -(kv.prefix_length + slots) :].expand(batch, queries, -1)
    if not bool(mask[:, :, : kv.prefix_length].all()):  # e.g. padding inside a shared level
        return False
    return mask[:, :, kv.prefix_length :]


def _check_positions(position_ids: object, kv: SharedBatchKV, suffix_mask: torch.Tensor | None) -> None:
    """InvalidInputError unless each row's last query that sees its own slot (a right-padded row's last real token)
    is the token right after the keys it sees: a multi-token forward that feeds cached tokens again (assisted
    decoding's first one, over a loaded prefix) would attend to them twice."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2:
        return  # M-RoPE models give (3, B, T) positions, not columns
    queries = position_ids.shape[1]
    if suffix_mask is None:
        last, seen, checked = position_ids[:, -1], kv.suffix_keys.shape[2], True
    else:
        own = suffix_mask[:, :, suffix_mask.shape[2] - queries :].diagonal(dim1=1, dim2=2)  # query i sees slot i
        last_query = torch.where(own, torch.arange(queries, device=own.device), -1).amax(dim=1)
        checked = last_query >= 0  # (a row of pads only sees nothing of its own)
        rows = torch.arange(own.shape[0], device=own.device)
        last_query = last_query.clamp(min=0)
        last = position_ids.expand(own.shape[0], -1)[rows, last_query]
        seen = suffix_mask[rows, last_query].sum(-1)
    if bool((checked & (last != kv.prefix_length + seen - 1)).any()):
        raise InvalidInputError(
            f"the forward's positions do not continue the HydragenCache ({kv.prefix_length} shared tokens, then "
            "each row's own): it feeds tokens the cache already holds, or positions that restart. Assisted decoding "
            "(prompt_lookup_num_tokens, assistant_model) feeds the whole prompt again on its first forward: "
            "generate without it over a loaded HydragenCache (or use HybridPrefixCache(store)); in a direct "
            "forward pass position_ids that continue the cache"
        )


def hydragen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | SharedBatchKV,
    value: torch.Tensor | SharedBatchKV,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: returns (B, Tq, Hq, D) like `sdpa_attention_forward`."""
    changed = [name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None]
    if changed:  # (Gemma 2's logit cap, T5-style / Inkling biases, gpt-oss' / Inkling2's attention sinks: sdpa's
        # fallback drops them too)
        raise InvalidInputError(f"hydragen attention computes plain softmax attention: this model changes its "
                                f"attention scores ({', '.join(changed)}); use another attn_implementation for it")
    if not isinstance(key, SharedBatchKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise InvalidInputError("hydragen attention is for inference: put the model in eval() mode (dropout=0)")
    suffix_mask = _suffix_mask(attention_mask, key, query.shape[2])
    if suffix_mask is False:  # a shared column is masked for some row: attend over the materialised rows instead
        keys, values = key.materialize()
        return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
    if query.shape[2] > 1:  # a prefill (one check per layer; decode steps follow generate's own positions)
        _check_positions(kwargs.get("position_ids"), key, suffix_mask)
    out = hydragen_attention(query, key.levels, key.suffix_keys, key.suffix_values, seq_levels=key.seq_levels,
                             suffix_mask=suffix_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "hydragen" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, hydragen_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
