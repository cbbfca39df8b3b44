"""Hydragen shared-prefix attention: split + packed tree on FlexAttention, SDPA reference, HF attention backend."""

from prefixlab.attention import hf as _hf  # noqa: F401  (registers attn_implementation="hydragen")
from prefixlab.attention.api import choose_method, hydragen_attention
from prefixlab.attention.compose import hydragen_cache_from_store
from prefixlab.attention.hf_cache import HydragenCache, SharedBatchKV
from prefixlab.attention.kernels import attention_with_lse, attention_with_lse_reference, combine_partials
from prefixlab.attention.packed import varlen_prefill_attention
from prefixlab.attention.tree import SharedLevel

__all__ = [
    "HydragenCache",
    "SharedBatchKV",
    "SharedLevel",
    "attention_with_lse",
    "attention_with_lse_reference",
    "choose_method",
    "combine_partials",
    "hydragen_attention",
    "hydragen_cache_from_store",
    "varlen_prefill_attention",
]
