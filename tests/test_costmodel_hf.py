"""ModelSpec.from_config: bytes exact against a tiny random-init model's cache, FLOPs against its weights."""

import functools

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BailingHybridConfig,
    BambaConfig,
    FalconH1Config,
    FalconMambaConfig,
    GemmaConfig,
    Glm5NextConfig,
    Glm5NextTextConfig,
    GPT2Config,
    GraniteMoeHybridConfig,
    Inkling2TextConfig,
    InklingTextConfig,
    JambaConfig,
    KimiLinearConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Lfm3Config,
    LlamaConfig,
    Mamba2Config,
    MambaConfig,
    MiniMaxConfig,
    MistralConfig,
    NemotronHConfig,
    OlmoHybridConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
    Qwen4ExpTextConfig,
    Zamba2Config,
    ZambaConfig,
    ZayaConfig,
)

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.hfspec import SUPPORTED_MODEL_TYPES
from prefixlab.cache.readers import DENSE_MODEL_TYPES
from prefixlab.errors import InvalidInputError, UnsupportedModelError

transformers.logging.set_verbosity_error()

DIMS = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
GDN = dict(head_dim=8, linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_conv_kernel_dim=3, num_hidden_layers=4)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3)
# MLA expands its latent to all heads before repeat_kv, so Kimi Linear runs only with kv heads == heads
KIMI = dict(**{**DIMS, "num_key_value_heads": 4}, pad_token_id=0, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"], linear_num_heads=2, linear_head_dim=8,
            linear_conv_kernel_dim=3, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=10,
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2)
# Ling: Kimi's layout (4-dim RoPE key, MLA needs kv heads == heads); one expert group
BAILING = dict(**{k: v for k, v in KIMI.items() if not k.startswith("linear_")}, head_dim=8, short_conv_kernel_size=3,
               n_group=1, topk_group=1)
# GLM-5-Next: Kimi's layers, NoPE MLA with a DSA indexer (layer 2 reuses layer 1's selection), hyper-connections;
# its only model class is the vision-language one (a tiny vision tower, run without images)
GLM5 = dict(**{**DIMS, "num_key_value_heads": 4}, pad_token_id=0, num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3, kv_lora_rank=12, q_lora_rank=8,
            qk_rope_head_dim=0, qk_nope_head_dim=6, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, n_shared_experts=2, index_topk=8, index_kpool=4, index_head_dim=6,
            index_n_heads=3, hc_mult=3, hc_sinkhorn_iters=2,
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                               projection_intermediate_size=16))
# Qwen4-Exp: GatedDeltaNet, indexed attention (QSA), MoE, hyper-connections, PLE on two of its GatedDeltaNet layers
QWEN4 = dict(**DIMS, **GDN, **QWEN_MOE, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16,
             heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8, eos_token_id=1,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2)

TINY = {
    "qwen3_5": lambda: Qwen3_5TextConfig(**DIMS, **GDN),
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(**DIMS, **GDN, **QWEN_MOE),
    "qwen3_next": lambda: Qwen3NextConfig(**DIMS, **GDN, **QWEN_MOE, mlp_only_layers=[1]),
    "qwen4_exp": lambda: Qwen4ExpTextConfig(**QWEN4),
    "nemotron_h": lambda: NemotronHConfig(
        **DIMS, head_dim=8, layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=3, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24),
    "bamba": lambda: BambaConfig(**DIMS, num_hidden_layers=3, attn_layer_indices=[1], **MAMBA2),
    "falcon_h1": lambda: FalconH1Config(**DIMS, num_hidden_layers=2, mamba_d_ssm=64, **MAMBA2),
    "granitemoehybrid": lambda: GraniteMoeHybridConfig(
        **DIMS, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=24, **MAMBA2),
    "jamba": lambda: JambaConfig(
        **DIMS, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=0, num_experts=4, mamba_d_state=8, mamba_d_conv=3, mamba_dt_rank=4,
        use_mamba_kernels=False),
    "zamba2": lambda: Zamba2Config(
        **DIMS, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8, mamba_d_conv=3,
        n_mamba_heads=4, mamba_ngroups=2, use_mamba_kernels=False),
    "zamba": lambda: ZambaConfig(
        **DIMS, num_hidden_layers=4, layers_block_type=["hybrid", "mamba", "hybrid", "mamba"], mamba_d_state=8,
        mamba_d_conv=3, mamba_dt_rank=4, n_mamba_heads=4),
    "lfm2": lambda: Lfm2Config(**DIMS, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                               conv_L_cache=3),
    "lfm2_moe": lambda: Lfm2MoeConfig(**DIMS, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                      conv_L_cache=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16),
    "lfm3": lambda: Lfm3Config(**DIMS, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                               conv_L_cache=5, head_dim=16, pad_token_id=0),
    "bailing_hybrid": lambda: BailingHybridConfig(**BAILING),
    "inkling": lambda: InklingTextConfig(
        **DIMS, num_hidden_layers=3, head_dim=8, local_layer_ids=[], mlp_layer_types=["sparse", "dense", "sparse"],
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, d_rel=4,
        rel_extent=16, conv_kernel_size=3),
    "inkling2": lambda: Inkling2TextConfig(
        **DIMS, num_hidden_layers=3, head_dim=8, layer_types=["hybrid"] * 3, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, d_rel=4, rel_extent=16, conv_kernel_size=3,
        n_layers_per_attn_res_block=2, eos_token_id=2),
    "zaya": lambda: ZayaConfig(**DIMS, num_hidden_layers=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                               router_hidden_size=12, cca_time0=3, cca_time1=2),
    "mamba2": lambda: Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                   state_size=8, n_groups=2, conv_kernel=3),
    "mamba": lambda: MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=3,
                                 conv_kernel=3, use_bias=True),
    "falcon_mamba": lambda: FalconMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=6,
                                              conv_kernel=3, time_step_rank=5),
    "olmo_hybrid": lambda: OlmoHybridConfig(
        **DIMS, num_hidden_layers=4, linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=3, pad_token_id=0),
    "kimi_linear": lambda: KimiLinearConfig(**KIMI),
    "minimax": lambda: MiniMaxConfig(**DIMS, num_hidden_layers=3, head_dim=16, block_size=4, num_local_experts=4,
                                     layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "glm5_next": lambda: Glm5NextConfig(**GLM5),
    # KV-only decoders; head_dim=16 differs from hidden / heads where the config has a head_dim
    "llama": lambda: LlamaConfig(**DIMS, num_hidden_layers=2, head_dim=16),
    "mistral": lambda: MistralConfig(**DIMS, num_hidden_layers=2, head_dim=16, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**DIMS, num_hidden_layers=2),
    "qwen3": lambda: Qwen3Config(**DIMS, num_hidden_layers=2, head_dim=16),
    "gemma": lambda: GemmaConfig(**DIMS, num_hidden_layers=2, head_dim=16, pad_token_id=0),
}
N_TOKENS = 9


@functools.cache
def run_tiny(model_type: str, dtype: torch.dtype):
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if model_type == "glm5_next" else AutoModelForCausalLM
    model = auto.from_config(TINY[model_type](), dtype=dtype).eval()
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()  # (from_pretrained keeps them; from_config not)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if any(key in name for key in keep):
            tensor.data = tensor.data.float()
    with torch.no_grad():
        out = model(torch.randint(0, 64, (1, N_TOKENS)), use_cache=True)
    return model, getattr(out, "past_key_values", None) or out.cache_params


def cache_tensors(cache):
    """(attention K/V tensors and DSA indexer keys, recurrent states, conv states) a transformers cache holds
    (MiniMaxCache: its lightning-attention states in its own `linear_cache` list)."""
    kv, conv = [], []
    recurrent = [t for t in getattr(cache, "linear_cache", ()) if isinstance(t, torch.Tensor)]
    for layer in cache.layers:
        kv += [t for t in (getattr(layer, name, None) for name in ("keys", "values", "indexer_keys"))
               if isinstance(t, torch.Tensor) and t.numel()]
        recurrent += [t for t in (getattr(layer, "recurrent_states", None) or {}).values() if t is not None]
        conv += [t for t in (getattr(layer, "conv_states", None) or {}).values() if t is not None]
    return kv, recurrent, conv


def test_every_supported_type_has_a_tiny_model():
    assert sorted(TINY) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_bytes_equal_the_cache_tensors(model_type, dtype):
    model, cache = run_tiny(model_type, dtype)
    spec = ModelSpec.from_config(model.config)
    kv, recurrent, conv = cache_tensors(cache)
    assert spec.dtype_bytes == dtype.itemsize
    assert spec.kv_bytes_per_token * N_TOKENS == sum(t.nbytes for t in kv)
    assert spec.state_bytes == sum(t.nbytes for t in recurrent + conv)
    assert (spec.state_bytes > 0) == (model_type not in DENSE_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_linear_flops_match_the_weights(model_type):
    model, cache = run_tiny(model_type, torch.float32)
    assert ModelSpec.from_config(model.config).linear_flops_per_token == pytest.approx(
        flops_from_weights(model, cache), rel=1e-12
    )


VARIANTS = {  # config branches the TINY models do not take
    "nemotron_h latent MoE": lambda: NemotronHConfig(**{**TINY["nemotron_h"]().to_dict(), "moe_latent_size": 8}),
    "granitemoehybrid without experts": lambda: GraniteMoeHybridConfig(
        **DIMS, num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=0,
        shared_intermediate_size=24, **MAMBA2),
    "qwen3_next sparse step 2": lambda: Qwen3NextConfig(**DIMS, **GDN, **QWEN_MOE, decoder_sparse_step=2),
    "kimi_linear low-rank Q": lambda: KimiLinearConfig(**KIMI, q_lora_rank=8),
    "lfm3 without the attention gate": lambda: Lfm3Config(**{**TINY["lfm3"]().to_dict(), "use_attention_gate": False}),
    "lfm2_moe all dense": lambda: Lfm2MoeConfig(**{**TINY["lfm2_moe"]().to_dict(), "num_dense_layers": 5}),
    "qwen3 sliding window off": lambda: Qwen3Config(**DIMS, num_hidden_layers=2, sliding_window=4,
                                                    use_sliding_window=False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_bytes_and_flops(variant):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(VARIANTS[variant]()).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 64, (1, N_TOKENS)), use_cache=True).past_key_values
    spec = ModelSpec.from_config(model.config)
    kv, recurrent, conv = cache_tensors(cache)
    assert spec.kv_bytes_per_token * N_TOKENS == sum(t.nbytes for t in kv)
    assert spec.state_bytes == sum(t.nbytes for t in recurrent + conv)
    assert spec.linear_flops_per_token == pytest.approx(flops_from_weights(model, cache), rel=1e-12)


def flops_from_weights(model, cache) -> float:
    """2 FLOPs per weight for every matmul a token meets (routers; routed experts scaled by top_k / E), 2 per
    depthwise conv weight, 8 per recurrent-state element (the scan), 2 per channel for the LFM short convs' B*x and
    C*y gates; GLM-5-Next's weights applied with F.linear (hyper-connections, indexer pool gate) and the
    hyper-connections' residual mix of N streams, 2 N N h each; never the vision tower."""
    config = model.config.get_text_config()
    expected = 0.0
    for name, module in model.named_modules():
        if "visual" in name:
            continue
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            expected += 2 * module.weight.numel()
        elif isinstance(module, torch.nn.Conv1d):
            expected += 2 * module.weight.numel()
    params = dict(model.named_parameters())
    router_names = ("mlp.gate.weight", "mixer.gate.weight", "router.weight", "feed_forward.gate.weight")
    routers = [p for name, p in params.items() if name.endswith(router_names)]
    expected += 2 * sum(p.numel() for p in routers)
    per_head = ("x_proj_weight", "dt_proj_weight")  # Zamba's per-head x_proj / dt_proj (3D parameters)
    expected += 2 * sum(p.numel() for name, p in params.items() if name.endswith(per_head))
    experts = [p for name, p in params.items()
               if p.dim() == 3 and "conv" not in name and not name.endswith((*per_head, "A_log"))
               and "shared" not in name]
    # Inkling: shared experts (3-D weights) always on; each head's relative states times its bias profiles;
    # Inkling2's dynamic convs: 2 FLOPs per static tap
    expected += 2 * sum(p.numel() for name, p in params.items() if name.endswith("static_weight"))
    expected += 2 * sum(p.numel() for name, p in params.items() if p.dim() == 3 and "shared_experts" in name)
    expected += 2 * sum(p.numel() * config.num_attention_heads
                        for name, p in params.items() if name.endswith("rel_logits_proj.proj"))
    if experts:
        n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) \
            or config.n_routed_experts
        expected += 2 * sum(p.numel() for p in experts) * config.num_experts_per_tok / n_experts
    _, recurrent, _ = cache_tensors(cache)
    # (ZAYA's recurrent state is the previous token's delayed V: no scan; MiniMax's is updated by k^T v, read by q S)
    expected += {"zaya": 0, "minimax": 4}.get(config.model_type, 8) * sum(t.numel() for t in recurrent)
    if config.model_type.startswith("lfm"):
        expected += 2 * config.hidden_size * config.layer_types.count("conv")
    for name, p in params.items():
        if name.endswith(("_hc.fn", "index_kpool_compress_gate")):
            expected += 2 * p.numel() + (2 * config.hc_mult**2 * config.hidden_size if name.endswith("fn") else 0)
    return expected


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_attention_pair_flops_count_query_and_value_widths(model_type):
    """Per (query, key) pair: 2 FLOPs per query channel (scores) and 2 per value channel (o_proj's input); a DSA
    indexer scores pools of keys, 2 H (d + 1) per (query, pool)."""
    model, _ = run_tiny(model_type, torch.float32)
    gated = model_type in {"qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp"}
    attention = [m for _, m in model.named_modules()  # GatedDeltaNet / KDA layers have a q_proj too
                 if (hasattr(m, "q_proj") or hasattr(m, "q_b_proj")) and not hasattr(m, "conv1d")
                 and not hasattr(m, "conv_qk_depthwise")]
    attention += [m for _, m in model.named_modules() if hasattr(m, "qkv_proj") and hasattr(m.qkv_proj, "q_proj")]
    indexers = [m.indexer for m in attention if getattr(m, "indexer", None) is not None]
    widths = [((getattr(getattr(m, "qkv_proj", m), "q_proj", None) or m.q_b_proj).out_features // (2 if gated else 1),
               (getattr(m, "o_proj", None) or m.out_proj).in_features) for m in attention]
    spec = ModelSpec.from_config(model.config)
    attention_layers = spec.layer_count("attention")
    if model_type == "zamba2":  # one shared block serves every hybrid layer
        widths = widths * attention_layers
    assert len(widths) == attention_layers
    assert spec.pair_flops == pytest.approx(2 * sum(q + v for q, v in widths) + sum(map(indexer_pair_flops, indexers)),
                                            rel=1e-12)


def indexer_pair_flops(indexer) -> float:
    """Per (query, key): a QSA indexer (Qwen4-Exp) scores blocks of `compress_ratio` keys, a DSA one (GLM-5-Next)
    pools of `index_kpool` keys and weighs its heads."""
    if hasattr(indexer, "compress_ratio"):
        return 2 * indexer.index_n_heads * indexer.index_head_dim / indexer.compress_ratio
    return 2 * indexer.n_heads * (indexer.head_dim + 1) / indexer.index_kpool


def test_default_configs_build():
    for config in (Qwen3_5TextConfig(), Qwen3NextConfig(), NemotronHConfig(), BambaConfig(), FalconH1Config(),
                   GraniteMoeHybridConfig(), JambaConfig(), ZambaConfig(), Zamba2Config(), Lfm2Config(), Mamba2Config(),
                   MambaConfig(), FalconMambaConfig(), OlmoHybridConfig(), KimiLinearConfig(), Glm5NextTextConfig(),
                   Lfm2MoeConfig(layer_types=["conv", "full_attention"] * 16), BailingHybridConfig(), LlamaConfig(),
                   Qwen2Config(), Qwen3Config(), GemmaConfig(), MistralConfig(sliding_window=None), MiniMaxConfig()):
        spec = ModelSpec.from_config(config, dtype=torch.bfloat16)
        recurrent = sum(spec.layer_count(k) for k in ("mamba", "mamba2", "gated_deltanet", "kda", "short_conv",
                                                      "lightning"))
        assert (spec.state_bytes > 0) == (recurrent > 0), type(config).__name__  # default Lfm2Config: attention only
        assert spec.state_bytes + spec.kv_bytes_per_token > 0
        assert spec.prefill_flops(4096) > spec.prefill_flops(2048) > 0


def test_multimodal_config_uses_its_text_config():
    composite = Qwen3_5Config(text_config=dict(**DIMS, **GDN))
    assert ModelSpec.from_config(composite) == ModelSpec.from_config(Qwen3_5TextConfig(**DIMS, **GDN))


def test_dtype_resolution():
    config = Qwen3_5TextConfig(**DIMS, **GDN)
    assert ModelSpec.from_config(config, dtype="bfloat16").dtype_bytes == 2
    assert ModelSpec.from_config(config, dtype=torch.float16).kv_bytes_per_token == 64
    with pytest.raises(InvalidInputError, match="dtype"):
        ModelSpec.from_config(config, dtype="float77")


def test_unsupported_model_lists_supported_types():
    with pytest.raises(UnsupportedModelError, match="gpt2") as raised:
        ModelSpec.from_config(GPT2Config())
    assert all(name in str(raised.value) for name in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("config", [
    MistralConfig(),  # sliding_window=4096 on every layer
    Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=2),
    Qwen3Config(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2, sliding_window=8),
    Lfm3Config(),  # LFM3-1.7B's layout: conv, sliding and full attention layers
], ids=["mistral", "qwen2", "qwen3", "lfm3"])
def test_windowed_models_are_refused(config):
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        ModelSpec.from_config(config)


def test_lfm2_moe_without_layer_types_is_refused():
    """Lfm2MoeConfig() leaves layer_types None (its model cannot be built from it): a clear error, not a TypeError."""
    with pytest.raises(InvalidInputError, match="layer_types"):
        ModelSpec.from_config(Lfm2MoeConfig())


def test_zaya_and_inklings_sliding_layers_and_zaya_conv_without_history_are_refused():
    with pytest.raises(UnsupportedModelError, match="hybrid_sliding"):  # (Inkling's default: 5 layers in 6)
        ModelSpec.from_config(InklingTextConfig(num_hidden_layers=6))
    with pytest.raises(UnsupportedModelError, match="hybrid_sliding"):  # (Inkling2's default: 5 layers in 6)
        ModelSpec.from_config(Inkling2TextConfig(num_hidden_layers=6))
    with pytest.raises(UnsupportedModelError, match="hybrid_sliding"):
        ModelSpec.from_config(ZayaConfig(num_hidden_layers=2, layer_types=["hybrid", "hybrid_sliding"],
                                         sliding_window=8))
    with pytest.raises(UnsupportedModelError, match="no history"):
        ModelSpec.from_config(ZayaConfig(num_hidden_layers=2, cca_time0=1, cca_time1=1))


@pytest.mark.parametrize(("config", "named"), [
    (LlamaConfig(**{**DIMS, "intermediate_size": -48}, num_hidden_layers=2), "intermediate=-48"),
    (LlamaConfig(**{**DIMS, "intermediate_size": 0}, num_hidden_layers=2), "intermediate=0"),
    (LlamaConfig(**{**DIMS, "num_key_value_heads": -2}, num_hidden_layers=2), "kv_heads=-2"),
    (Qwen3_5TextConfig(**DIMS, **{**GDN, "linear_num_value_heads": -4}), "v_heads=-4"),
    (Qwen3_5TextConfig(**DIMS, **{**GDN, "linear_conv_kernel_dim": 0}), "conv_kernel=0"),
    (Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=-8,
                  n_groups=2, conv_kernel=3), "state_size=-8"),
], ids=["negative-mlp", "zero-mlp", "negative-kv-heads", "negative-gdn-heads", "zero-conv", "negative-state"])
def test_nonsense_sizes_are_refused(config, named):
    """Negative or zero sizes gave negative bytes or FLOPs; optional parts (no shared expert) may still be 0."""
    with pytest.raises(InvalidInputError, match=named):
        ModelSpec.from_config(config)
    no_shared = Qwen3_5MoeTextConfig(**DIMS, **GDN, **{**QWEN_MOE, "shared_expert_intermediate_size": 0})
    assert ModelSpec.from_config(no_shared).prefill_flops(8) > 0
