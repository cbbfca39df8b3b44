"""Hydragen shared-prefix attention: split + packed tree on FlexAttention, SDPA reference, HF attention backend."""

from prefixlab.attention.api import choose_method, hydragen_attention
from prefixlab.attention.kernels import attention_with_lse, attention_with_lse_reference, combine_partials
from prefixlab.attention.tree import SharedLevel

__all__ = [
    "SharedLevel",
    "attention_with_lse",
    "attention_with_lse_reference",
    "choose_method",
    "combine_partials",
    "hydragen_attention",
]
