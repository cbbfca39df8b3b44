"""Tiny random-init models of every family prefixlab serves, built from the real transformers config classes (fp32,
no downloads). Shared by tests/test_hf_*.py and benchmarks/test_bench_hf.py."""

from __future__ import annotations

import os

import torch
import transformers as tf

from prefixlab.cache.hf_minimax import dynamic_cache

VOCAB = 128
# PREFIXLAB_TEST_DEVICE=cuda runs the device-aware tests (the random stream, the numeric contract) on a GPU
# (benchmarks/gpu_check.sh; CI has none)
TEST_DEVICE = torch.device(os.environ.get("PREFIXLAB_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda":  # fp32 means fp32: cuDNN's convolutions (the short convs) would otherwise run in TF32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
torch.set_num_threads(1)  # tiny matmuls: threads only add contention on the shared test machine
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_GDN = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Qwen4-Exp: the QSA indexer keeps 2 blocks of 2 keys (+ the partial block) per query, so prompts over ~6 tokens
# attend sparsely; PLE (n-gram embeddings, dilated conv) on two of the GatedDeltaNet layers
_QWEN4 = dict(layer_types=["linear_attention"] * 3 + ["indexed_attention"], ple_layer_ids=[1, 3], ple_embed_dim=32,
              heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8, hc_count=2,
              hc_lowrank=16, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
              indexer_compress_ratio=2)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=16, mamba_chunk_size=8,
               mamba_n_groups=1)
_LFM = ["conv", "conv", "conv", "full_attention"]  # (LFM3 checkpoints' sliding-window layers are not served)

# family -> (config class, model class, config overrides); every model has attention and recurrent layers where
# its family has them (3:1 for the GatedDeltaNet families, as Qwen3.5).
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(num_hidden_layers=2)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(num_hidden_layers=2)),
    # the README's other KV-only rows (Mistral's default sliding_window=4096 is refused: full attention here)
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_hidden_layers=2)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(num_hidden_layers=2, sliding_window=None)),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(num_hidden_layers=2)),
    "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(num_hidden_layers=4, **_GDN)),
    "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(num_hidden_layers=4, **_GDN, **_QWEN_MOE)),
    "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(num_hidden_layers=4, **_GDN, **_QWEN_MOE)),
    "qwen4_exp": (tf.Qwen4ExpTextConfig, tf.Qwen4ExpForCausalLM, dict(
        num_hidden_layers=4, **{**_GDN, **_QWEN4}, **_QWEN_MOE)),
    "olmo_hybrid": (tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM, dict(num_hidden_layers=4, **_GDN)),
    "kimi_linear": (tf.KimiLinearConfig, tf.KimiLinearForCausalLM, dict(
        num_hidden_layers=4, num_key_value_heads=4,
        linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 4, "head_dim": 16,
                            "short_conv_kernel_size": 4})),
    "bamba": (tf.BambaConfig, tf.BambaForCausalLM, dict(num_hidden_layers=4, attn_layer_indices=[3], **_MAMBA2)),
    "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM, dict(num_hidden_layers=2, mamba_d_ssm=128, **_MAMBA2)),
    "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM, dict(
        num_hidden_layers=4, layer_types=["mamba", "mamba", "mamba", "attention"], num_local_experts=4,
        num_experts_per_tok=2, **_MAMBA2)),
    "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM, dict(
        hybrid_override_pattern="M-M*", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, chunk_size=8,
        n_groups=1)),
    "jamba": (tf.JambaConfig, tf.JambaForCausalLM, dict(
        num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2)),
    "zamba2": (tf.Zamba2Config, tf.Zamba2ForCausalLM, dict(
        num_hidden_layers=4, layers_block_type=["mamba", "mamba", "hybrid", "mamba"], mamba_d_state=16,
        mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1, chunk_size=8, num_mem_blocks=1)),
    "bailing_hybrid": (tf.BailingHybridConfig, tf.BailingHybridForCausalLM, dict(
        num_hidden_layers=4, num_key_value_heads=4, layer_group_size=4, short_conv_kernel_size=4, n_group=1,
        topk_group=1, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # (transformers 5.23 cannot build a Zamba with a single hybrid layer: its tied-weights pattern matches nothing)
    "zamba": (tf.ZambaConfig, tf.ZambaForCausalLM, dict(
        num_hidden_layers=4, layers_block_type=["hybrid", "mamba", "hybrid", "mamba"], mamba_d_state=8,
        mamba_dt_rank=8, n_mamba_heads=2)),
    "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM, dict(
        num_hidden_layers=4, layer_types=_LFM, conv_L_cache=3)),
    "lfm2_moe": (tf.Lfm2MoeConfig, tf.Lfm2MoeForCausalLM, dict(
        num_hidden_layers=4, layer_types=_LFM, conv_L_cache=3, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32)),
    "lfm3": (tf.Lfm3Config, tf.Lfm3ForCausalLM, dict(num_hidden_layers=4, layer_types=_LFM, conv_L_cache=4)),
    "zaya": (tf.ZayaConfig, tf.ZayaForCausalLM, dict(
        num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, router_hidden_size=16)),
    "inkling": (tf.InklingTextConfig, tf.InklingForCausalLM, dict(
        num_hidden_layers=2, local_layer_ids=[], mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, d_rel=4, rel_extent=16, conv_kernel_size=3)),
    "inkling2": (tf.Inkling2TextConfig, tf.Inkling2ForCausalLM, dict(
        num_hidden_layers=2, layer_types=["hybrid"] * 2, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, d_rel=8, rel_extent=12, conv_kernel_size=3, log_scaling_n_floor=8,
        n_layers_per_attn_res_block=1)),  # (with d_rel=4, rel_extent=16 greedy decoding gives the pad id 0)
    # lightning attention (no conv; its state outside transformers' cache layers: cache/hf_minimax.py) in blocks of 8
    "minimax": (tf.MiniMaxConfig, tf.MiniMaxForCausalLM, dict(
        num_hidden_layers=4, layer_types=_GDN["layer_types"], block_size=8, num_local_experts=4,
        num_experts_per_tok=2)),
    "mamba2": (tf.Mamba2Config, tf.Mamba2ForCausalLM, dict(
        num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, chunk_size=8, n_groups=1, expand=2)),
    "mamba": (tf.MambaConfig, tf.MambaForCausalLM, dict(num_hidden_layers=2, state_size=16, expand=2)),
    "falcon_mamba": (tf.FalconMambaConfig, tf.FalconMambaForCausalLM, dict(num_hidden_layers=2, state_size=16)),
    # KDA + MLA with a DSA indexer (a "shared" layer reusing the previous one's selection) over 4-token pools, 8 of
    # which (+ the tail) a query attends to: tokens from 35 on attend sparsely, and are never stored
    # (hfspec.selection_limit; the workloads here reuse up to 34). A tiny vision tower, unused.
    "glm5_next": (tf.Glm5NextConfig, tf.Glm5NextForConditionalGeneration, dict(
        num_hidden_layers=4, num_key_value_heads=4,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        linear_num_heads=4, linear_head_dim=16, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        index_topk=32, index_kpool=4, index_head_dim=16, index_n_heads=2, hc_mult=2, hc_sinkhorn_iters=4,
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                           projection_intermediate_size=32))),
}


def config(family: str):
    """The tiny config of `family`."""
    config_class, _, overrides = FAMILIES[family]
    return config_class(**(_COMMON | overrides))


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 random-init model of `family`, in eval mode."""
    torch.manual_seed(seed)
    model = FAMILIES[family][1](config(family)).eval()
    with torch.no_grad():  # Qwen4-Exp inits its PLE convs to zeros: random, so that their conv states matter
        for name, param in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                param.normal_(std=0.5)
    return model


def cache_argument(model: torch.nn.Module) -> str:
    """The generate() keyword a family takes its cache under (Mamba, Falcon-Mamba, Mamba2: cache_params)."""
    return "cache_params" if "mamba" in type(model).__name__.lower() else "past_key_values"


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random token ids (none of the special ids 0-2) of `shape`, by seed."""
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def reference_cache(model: torch.nn.Module):
    """The cache an uncached reference generate() passes: None (the model's default cache), except for MiniMax,
    whose default MiniMaxCache() is built without the config, so transformers 5.23 masks its decode steps as if
    nothing were cached (masking_utils.find_first_full_attention_index picks its layer 0, an empty DynamicLayer of a
    linear-attention layer): left-padded rows then attend their pads' keys (test_minimax_default_cache_...); and
    its beam search does not reorder the lightning states (test_minimax_beam_search_...). The reference is then
    transformers' own layers over a cache built from the config (cache/hf_minimax.py)."""
    return dynamic_cache(model.config) if model.config.model_type == "minimax" else None


def generate(model: torch.nn.Module, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
    """Greedy generate of 4 tokens (`kwargs` override), through `cache` where given."""
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0) | kwargs
    if cache is not None:
        options[cache_argument(model)] = cache
    return model.generate(input_ids, **options)
