"""End-to-end decode throughput of N completions of one prompt, as in the Hydragen paper, on tiny random models.

Three runs of the same `generate` (sampled, same seed) from the same prefilled prompt:
- standard: sdpa + DynamicCache holding N copies of the prompt KV;
- hydragen: attn_implementation="hydragen" + HydragenCache holding it once;
- no-attention ceiling: attention output replaced by zeros (a speed bound only: its tokens are meaningless).
The prompt is prefilled once (batch 1) and handed to each cache, so the timings are decode only; each run is timed
after an untimed warm-up generate of two tokens (compiles, CUDA library handles), the best of `repeats`.
`qwen3_5_4b` is a random-init Qwen3.5-shaped hybrid of ~4 B parameters (32 layers, 3 : 1 GatedDeltaNet to
attention, 16 / 4 heads of 256), built directly on the device in the run's dtype: a GPU model, for issue 12's
end-to-end point at a real size.
"""

from __future__ import annotations

import time

import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from prefixlab.attention.hf_cache import HydragenCache
from prefixlab.attention.kernels import active_cuda_lse_kernels
from prefixlab.bench import check_device, check_sizes
from prefixlab.errors import InvalidInputError

VOCAB = 1024
ZEROS = "prefixlab_zeros"


MODELS = ("llama", "qwen3_5", "qwen3_5_4b")


def qwen3_5_4b_config() -> Qwen3_5TextConfig:
    """Qwen3.5-shaped, ~4 B parameters: 32 layers (every fourth full attention, 16 query / 4 KV heads of 256),
    GatedDeltaNet with 16 key / 32 value heads of 128, hidden 2560, vocabulary 151,936."""
    return Qwen3_5TextConfig(vocab_size=151936, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                             max_position_embeddings=65536, tie_word_embeddings=True, pad_token_id=0)


def tiny_model(name: str) -> torch.nn.Module:
    """A random-init fp32 model with Llama-like attention shape (8 query heads : 1 KV head, head_dim 128)."""
    shape = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=32768, pad_token_id=0)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **shape))
    elif name == "qwen3_5":
        # Qwen3.5's pattern: three Gated DeltaNet layers per full-attention layer
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(num_hidden_layers=8, linear_num_key_heads=4,
                                                     linear_num_value_heads=8, linear_key_head_dim=64,
                                                     linear_value_head_dim=64, **shape))
    else:
        raise InvalidInputError(f"model={name!r} must be one of {list(MODELS)}")
    return model.eval()


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The named model on `device` in `dtype`; the 4 B one is built there directly (no host copy of its weights)."""
    if name != "qwen3_5_4b":
        return tiny_model(name).to(device=device, dtype=dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3_5ForCausalLM(qwen3_5_4b_config()).eval()
    finally:
        torch.set_default_dtype(default)


def _zero_attention(module, query, key, value, attention_mask, **kwargs):
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None


def _prefill(model, prompt: torch.Tensor):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
    return cache


def _prefix_inputs(prefilled: DynamicCache, completions: int) -> dict:
    layers = dict(enumerate(prefilled.layers))
    attention = {i: layer for i, layer in layers.items() if getattr(layer, "keys", None) is not None}
    recurrent = {i: layer for i, layer in layers.items() if hasattr(layer, "recurrent_states")}
    return dict(keys={i: layer.keys for i, layer in attention.items()},
                values={i: layer.values for i, layer in attention.items()},
                conv_states={i: layer.conv_states[0] for i, layer in recurrent.items()},
                recurrent_states={i: layer.recurrent_states[0] for i, layer in recurrent.items()},
                batch_size=completions)


def _standard_cache(model, prefilled: DynamicCache, completions: int) -> DynamicCache:
    """A DynamicCache holding the prefilled prompt once per completion, as generate would build it."""
    cache = DynamicCache(config=model.config)
    for layer, source in zip(cache.layers, prefilled.layers, strict=True):
        if getattr(source, "keys", None) is not None:
            layer.update(source.keys.repeat(completions, 1, 1, 1), source.values.repeat(completions, 1, 1, 1))
        if hasattr(source, "recurrent_states"):
            conv = source.conv_states[0].repeat(completions, 1, 1)
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=conv.shape[-1])
            layer.conv_states[0].copy_(conv)
            layer.update_recurrent_state(source.recurrent_states[0].repeat(completions, 1, 1, 1))
            layer.has_previous_state[0] = True
    return cache


def _timed_generate(model, prompt, cache, completions: int, new_tokens: int) -> tuple[float, torch.Tensor]:
    sync = torch.cuda.synchronize if prompt.device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, do_sample=True, num_return_sequences=completions,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    sync()
    return time.perf_counter() - start, out


def bench_e2e(model_name: str = "llama", completions: int = 64, prompt_tokens: int = 2048, new_tokens: int = 32,
              repeats: int = 1, device: str = "cpu", dtype: str = "fp32") -> dict:
    """Decode tokens/s of standard generate, Hydragen generate and the no-attention ceiling, on `device` in `dtype`
    (fp32 / bf16 / fp16). In fp32 on CPU the two generates' tokens are identical; in bf16 / fp16 they need not be
    (Hydragen's LSE combine rounds differently from SDPA's single softmax), and `same_tokens` says which it was."""
    from prefixlab.bench.hydragen import DTYPES

    check_sizes(completions=completions, prompt=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    device = check_device(device)
    AttentionInterface.register(ZEROS, _zero_attention)
    AttentionMaskInterface.register(ZEROS, sdpa_mask)
    torch.manual_seed(0)
    if model_name not in MODELS:
        raise InvalidInputError(f"model={model_name!r} must be one of {list(MODELS)}")
    if model_name == "qwen3_5_4b" and device.type != "cuda":
        raise InvalidInputError("--model qwen3_5_4b is a ~4 B-parameter model for a GPU (--device cuda); on "
                                f"{device.type} use --model llama or qwen3_5")
    model = build_model(model_name, device, DTYPES[dtype])
    prompt = torch.randint(1, min(VOCAB, model.config.vocab_size), (1, prompt_tokens)).to(device)
    prefilled = _prefill(model, prompt[:, :-1])  # generate then feeds the last prompt token
    runs = {
        "standard": ("sdpa", lambda: _standard_cache(model, prefilled, completions)),
        "hydragen": ("hydragen", lambda: _loaded(model, prefilled, completions)),
        "no_attention": (ZEROS, lambda: _loaded(model, prefilled, completions)),
    }
    result = dict(model=model_name, completions=completions, prompt=prompt_tokens, new_tokens=new_tokens,
                  device=str(device), dtype=dtype, threads=torch.get_num_threads(),
                  lse_kernels=active_cuda_lse_kernels() if device.type == "cuda" else None)
    outputs = {}
    for name, (implementation, make_cache) in runs.items():
        model.set_attn_implementation(implementation)
        _timed_generate(model, prompt, make_cache(), completions, 2)  # warm-up: compiles, library handles
        seconds = []
        for _ in range(repeats):
            elapsed, outputs[name] = _timed_generate(model, prompt, make_cache(), completions, new_tokens)
            seconds.append(elapsed)
        result[f"{name}_tok_s"] = completions * new_tokens / min(seconds)
    model.set_attn_implementation("sdpa")
    result["same_tokens"] = bool(torch.equal(outputs["standard"], outputs["hydragen"]))
    result["speedup"] = result["hydragen_tok_s"] / result["standard_tok_s"]
    result["ceiling_speedup"] = result["no_attention_tok_s"] / result["standard_tok_s"]
    return result


def _loaded(model, prefilled: DynamicCache, completions: int) -> HydragenCache:
    cache = HydragenCache(model.config)
    cache.load_shared_prefix(**_prefix_inputs(prefilled, completions))
    return cache


def format_e2e(result: dict) -> str:
    return (
        f"hydragen e2e  {result['model']}, {result['completions']} completions of a {result['prompt']}-token "
        f"prompt, {result['new_tokens']} new tokens each, {result['dtype']} on {result['device']} "
        f"({result['threads']} threads)\n"
        f"  standard generate     {result['standard_tok_s']:.1f} tok/s\n"
        f"  hydragen generate     {result['hydragen_tok_s']:.1f} tok/s  ({result['speedup']:.2f}x, same tokens: "
        f"{result['same_tokens']})\n"
        f"  no-attention ceiling  {result['no_attention_tok_s']:.1f} tok/s  ({result['ceiling_speedup']:.2f}x)"
    )
