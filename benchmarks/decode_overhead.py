"""What a decode step costs through prefixlab: one-token forwards over a HybridPrefixCache (the model patched by
its store) against the same model's plain transformers cache, interleaved step by step (the machine's state hits
both alike), GPU work waited for. Both run greedy from one prompt; their tokens are compared (fp32: identical).

    python benchmarks/decode_overhead.py --family qwen3_5 --steps 300            # CPU, the demo's tiny hybrid
    python benchmarks/decode_overhead.py --size small --dtype bf16 --steps 200  # a GPU: the ~0.5 B hybrid

At a tiny size, or on a GPU where small kernels wait on the host, a step's cost is mostly host time: the layers'
Python, the cache's hooks. One JSON line: the median step of each path and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from serve_accelerate import SIZES
from transformers import BambaConfig, BambaForCausalLM, DynamicCache, Qwen3_5ForCausalLM

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.bench.hydragen import DTYPES
from prefixlab.demo import tiny_hybrid_config

VOCAB = 512


def build(family: str, size: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-init model: the demo's Qwen3.5-architecture hybrid (GatedDeltaNet) or a Bamba (Mamba2) of the same
    width, 3 recurrent layers to 1 attention layer."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        model = Qwen3_5ForCausalLM(tiny_hybrid_config(VOCAB, **SIZES[size]))
    else:
        width, layers = (256, 4) if size == "tiny" else (1024, 24)
        model = BambaForCausalLM(BambaConfig(
            vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
            attn_layer_indices=list(range(3, layers, 4)), num_attention_heads=4,
            num_key_value_heads=2, mamba_n_heads=width // 32, mamba_d_head=64, mamba_expand=2, mamba_d_state=64,
            mamba_n_groups=1, mamba_chunk_size=64, tie_word_embeddings=True, pad_token_id=0))
    return model.to(device=device, dtype=dtype).eval()


def step_seconds(plain: torch.nn.Module, cached: torch.nn.Module, store: PrefixStore, prompt: torch.Tensor,
                 steps: int, sync) -> tuple[list[float], list[float], bool]:
    """(plain step seconds, prefixlab step seconds, whether both decoded the same tokens): after one prefill of
    `prompt` each, `steps` greedy one-token forwards alternating between the two."""
    caches = [DynamicCache(config=plain.config), HybridPrefixCache(store)]
    models, seconds, tokens = [plain, cached], [[], []], [[], []]
    nexts = []
    for model, cache in zip(models, caches, strict=True):
        nexts.append(model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1))
    for step in range(steps):
        position = torch.full((prompt.shape[0], 1), prompt.shape[1] + step, device=prompt.device)
        for i, (model, cache) in enumerate(zip(models, caches, strict=True)):
            sync()
            start = time.perf_counter()
            logits = model(input_ids=nexts[i], past_key_values=cache, use_cache=True, position_ids=position).logits
            nexts[i] = logits[:, -1:].argmax(-1)
            sync()
            seconds[i].append(time.perf_counter() - start)
            tokens[i].append(nexts[i])
    return seconds[0], seconds[1], torch.equal(torch.cat(tokens[0]), torch.cat(tokens[1]))


def measure(family: str = "qwen3_5", size: str = "tiny", dtype: str = "fp32", steps: int = 300, prompt: int = 64,
            device: str | None = None, batch: int = 1) -> dict:
    """The JSON record: median step milliseconds of each path, their ratio, whether the tokens matched."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    plain = build(family, size, DTYPES[dtype], device)
    cached = copy.deepcopy(plain)  # the store patches this one; `plain` keeps transformers' layers
    store = PrefixStore(cached, capacity="4GiB")
    ids = torch.randint(3, VOCAB - 1, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        step_seconds(plain, cached, store, ids, 10, sync)  # warm-up: allocations, lazy inits
        plain_s, cached_s, same = step_seconds(plain, cached, store, ids, steps, sync)
    store.close()
    plain_ms, cached_ms = (sorted(s)[len(s) // 2] * 1e3 for s in (plain_s, cached_s))
    return {"family": family, "size": size, "dtype": dtype, "device": device, "batch": batch, "steps": steps,
            "plain_step_ms": round(plain_ms, 4), "prefixlab_step_ms": round(cached_ms, 4),
            "ratio": round(cached_ms / plain_ms, 4), "tokens_identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_5", choices=("qwen3_5", "bamba"))
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens before the decode steps")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (one prompt each)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.family, args.size, args.dtype, args.steps, args.prompt, batch=args.batch)))


if __name__ == "__main__":
    main()
