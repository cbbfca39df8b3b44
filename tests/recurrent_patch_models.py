"""Tiny random-init hybrid models, one per layer family prefixlab.recurrent.patch serves (no downloads).

Each has at least one linear-attention (or conv) layer and, where the architecture has them, one attention layer.
`build` re-draws the weights at unit scale: the library's init (std 0.02) makes recurrent contributions so small
that a layer restarting from a zero state would still pass a 1e-5 comparison.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import transformers
from transformers import DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from prefixlab.cache.hf_minimax import dynamic_cache
from prefixlab.recurrent import patch, unpatch

VOCAB = 64
TOL = 1e-5  # fp32 logits and states against transformers' own layers
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
)
_GDN = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
_MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
)
_HYBRID = ["linear_attention", "full_attention"]

CONFIGS: dict[str, dict] = {
    "qwen3_5_text": dict(**_COMMON, **_GDN, num_hidden_layers=2, head_dim=8, layer_types=_HYBRID),
    "qwen3_5_moe_text": dict(**_COMMON, **_GDN, **_MOE, num_hidden_layers=2, head_dim=8, layer_types=_HYBRID),
    "qwen3_next": dict(**_COMMON, **_GDN, **_MOE, num_hidden_layers=2, head_dim=8, layer_types=_HYBRID),
    # GatedDeltaNet with PLE (two more states in its cache layer: families/ple.py) + indexed attention
    "qwen4_exp_text": dict(
        **_COMMON, **_GDN, **_MOE, num_hidden_layers=2, head_dim=8, layer_types=["linear_attention",
                                                                               "indexed_attention"],
        ple_layer_ids=[1], ple_embed_dim=16, heads_per_ngram=2, ngram_vocab_size_base=97,
        make_ngram_vocab_size_divisible_by=8, hc_count=2, hc_lowrank=8, eos_token_id=1, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2),
    "olmo_hybrid": dict(**_COMMON, **_GDN, num_hidden_layers=2, layer_types=_HYBRID),
    "kimi_linear": dict(
        **{**_COMMON, "num_key_value_heads": 4},
        num_hidden_layers=2,
        layer_types=_HYBRID,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        mlp_layer_types=["dense", "dense"],
    ),
    "bailing_hybrid": dict(
        **{**_COMMON, "num_key_value_heads": 4},
        num_hidden_layers=2,
        layer_types=_HYBRID,
        head_dim=8,
        short_conv_kernel_size=4,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        mlp_layer_types=["dense", "dense"],
    ),
    "mamba2": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=8,
        state_size=8,
        expand=2,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
    ),
    # KDA + MLA with a DSA indexer selecting 4 pools of 4 (+ the tail): sparse from token 19 on (hfspec.selection_limit)
    "glm5_next": dict(
        **{**_COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "dense"],
        linear_head_dim=8,
        linear_num_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=0,
        v_head_dim=8,
        qk_nope_head_dim=8,
        index_topk=16,
        index_kpool=4,
        index_head_dim=8,
        index_n_heads=2,
        hc_mult=2,
        hc_sinkhorn_iters=4,
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                           projection_intermediate_size=16),
    ),
    "bamba": dict(**_COMMON, **_MAMBA, num_hidden_layers=2, attn_layer_indices=[1]),
    "nemotron_h": dict(
        **_COMMON,
        layers_block_type=["mamba", "attention", "mlp"],
        head_dim=8,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=8,
    ),
    "falcon_h1": dict(**_COMMON, **_MAMBA, num_hidden_layers=2, mamba_d_ssm=64),
    "granitemoehybrid": dict(
        **_COMMON,
        **_MAMBA,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
    ),
    "zamba2": dict(
        **_COMMON,
        num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=2,
        n_mamba_heads=8,
        chunk_size=8,
        num_mem_blocks=1,
        adapter_rank=4,
    ),
    "jamba": dict(
        **_COMMON,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    "zamba": dict(
        **_COMMON,
        num_hidden_layers=3,
        layers_block_type=["hybrid", "mamba", "hybrid"],  # (one hybrid layer: transformers 5.23 cannot build it)
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        n_mamba_heads=2,
    ),
    "mamba": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4),
    "falcon_mamba": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4),
    "lfm2": dict(**_COMMON, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3),
    "lfm2_moe": dict(
        **_COMMON,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        moe_intermediate_size=16,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "zaya": dict(**_COMMON, num_hidden_layers=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                 router_hidden_size=16, cca_time0=3, cca_time1=2),
    "inkling_text": dict(**_COMMON, num_hidden_layers=2, head_dim=8, local_layer_ids=[],
                         mlp_layer_types=["dense", "sparse"], moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, d_rel=4, rel_extent=16, conv_kernel_size=3),
    "inkling2_text": dict(**_COMMON, num_hidden_layers=2, head_dim=8, layer_types=["hybrid"] * 2,
                          moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, d_rel=4, rel_extent=16,
                          conv_kernel_size=3, log_scaling_n_floor=8, n_layers_per_attn_res_block=1, eos_token_id=2),
    "lfm3": dict(**_COMMON, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3, head_dim=8),
    # lightning attention (no conv) in blocks of 4 tokens, then GQA; Mixtral-style MoE
    "minimax": dict(**_COMMON, num_hidden_layers=2, head_dim=8, layer_types=_HYBRID, block_size=4,
                    num_local_experts=4, num_experts_per_tok=2),
}

# Models whose forward takes the cache as `cache_params` (pure Mamba / Mamba2) and has no positions.
_CACHE_PARAMS = {"mamba", "mamba2", "falcon_mamba"}


def transformers_classes(name: str) -> tuple[type, type]:
    """transformers' own config and causal-LM classes for model type `name`, by their names. Not the Auto mappings:
    importing fla (transformers does, for its GatedDeltaNet layers, on a CUDA machine with fla installed) registers
    fla's own models under "mamba" and "mamba2" there, and AutoModel then builds those (seen on an H200, fla 0.6)."""
    # (GLM-5-Next has no causal-LM class: its image-text-to-text one)
    model = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(name) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[name]
    return getattr(transformers, CONFIG_MAPPING_NAMES[name]), getattr(transformers, model)


def build(name: str, seed: int = 0, scale: float = 0.5, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny `name` model in eval mode with weights redrawn (matrices ~ scale / sqrt(fan_in), vectors jittered)."""
    torch.manual_seed(seed)
    config_class, model_class = transformers_classes(name)
    model = model_class._from_config(config_class(**CONFIGS[name]), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() >= 2:
                param.copy_(noise * scale / param.shape[-1] ** 0.5)
            else:  # norms, biases, A_log, dt_bias, D: keep the library's values, jittered
                param.add_(noise * (0.1 if param_name.endswith("A_log") else 0.3))
    return model.to(dtype)


def new_cache(model: torch.nn.Module) -> DynamicCache:
    return dynamic_cache(model.config)  # (MiniMax's forward takes only a MiniMaxCache)


def forward(model: torch.nn.Module, ids: torch.Tensor, cache=None, start: int = 0, attention_mask=None):
    """Logits of `ids` [B, T] continuing `cache` after `start` tokens (explicit positions: some models, e.g. Bamba,
    otherwise restart RoPE at 0 on every call)."""
    kwargs = {"use_cache": cache is not None, "attention_mask": attention_mask}
    if model.config.model_type in _CACHE_PARAMS:
        kwargs["cache_params"] = cache
    else:
        kwargs["past_key_values"] = cache
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        kwargs["position_ids"] = positions[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


Slot = int | tuple[int, int]  # a cache layer's state 0, or (layer, i) for its state i > 0 (Inkling: 4 per layer)


def linear_layer_indices(cache: DynamicCache) -> list[Slot]:
    """Cache slots that hold conv / recurrent states: each layer's state 0, then (layer, i) for the others."""
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")]
    return [i for i, _ in layers] + [(i, s) for i, layer in layers for s in range(1, layer.number_of_states)
                                     if layer.is_conv_states_initialized[s]]


def states(cache: DynamicCache, slot: Slot) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(conv state, recurrent state or None) a cache slot holds, cloned."""
    layer_idx, state_idx = slot if isinstance(slot, tuple) else (slot, 0)
    layer = cache.layers[layer_idx]
    conv, recurrent = layer.conv_states[state_idx], layer.recurrent_states[state_idx]
    return tuple(None if state is None else state.clone() for state in (conv, recurrent))  # (MiniMax: no conv)


class _Recording:
    """Asks patched layers for states at `positions` and keeps what they record, by (slot, offset, row)."""

    def prefixlab_record(self, layer_idx, offset, conv_state, recurrent_state, row=None, state_idx=0):
        slot = (layer_idx, state_idx) if state_idx else layer_idx
        assert (slot, offset, row) not in self.records, "each state is recorded once"
        self.records[(slot, offset, row)] = (conv_state, recurrent_state)


def RecordingCache(model, positions) -> DynamicCache:  # noqa: N802 (it reads as the class it builds)
    """A cache of the model's class (new_cache) that records what patched layers hand it (_Recording)."""
    cache = type("RecordingCache", (_Recording, type(new_cache(model))), {})(config=model.config)
    cache.prefixlab_capture_positions = positions
    cache.records = {}
    return cache


@contextmanager
def unpatched(model):
    """Run a block on transformers' own layers (the reference), re-patching after."""
    unpatch(model)
    try:
        yield model
    finally:
        patch(model)


def reference_states(model, ids, attention_mask=None):
    """The cache a forward over `ids` with transformers' own layers leaves."""
    cache = new_cache(model)
    with unpatched(model):
        forward(model, ids, cache, attention_mask=attention_mask)
    return cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    error = (actual - expected).abs().max().item()
    assert error <= tol, f"max abs error {error:.3g} > {tol}"


def assert_same_states(recorded, expected) -> None:
    """Recorded (conv, recurrent) states match a cache slot's in shape, dtype and value."""
    for got, want in zip(recorded, expected, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want)
