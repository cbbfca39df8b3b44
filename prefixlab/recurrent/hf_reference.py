"""transformers' own torch paths, unwrapped from their hub-kernel decorators: the references we test and time against.

Unwrapping matters: with fla / mamba_ssm installed the decorated names dispatch to those packages instead."""

from __future__ import annotations

import inspect

from transformers.models.jamba import modeling_jamba
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.qwen3_next import modeling_qwen3_next

hf_chunk_gated_delta_rule = inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule)
hf_recurrent_gated_delta_rule = inspect.unwrap(modeling_qwen3_next.torch_recurrent_gated_delta_rule)
hf_chunk_kda = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
hf_mamba2_chunk_scan = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
hf_causal_conv1d_fn = inspect.unwrap(modeling_qwen3_next.causal_conv1d_fn)
hf_mamba_selective_scan = inspect.unwrap(modeling_jamba.mamba_selective_scan)
