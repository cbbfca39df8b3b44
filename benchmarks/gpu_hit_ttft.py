"""Hit TTFT at a long cached prefix (issue 12: 32K cached tokens, a 64-token suffix, target <= 1.2x the floor).

generate() on a store hit — lookup, copies into the cache, hooks, the suffix prefill, the first token — against the
floor: generate() from a ready DynamicCache already holding the prefix's KV and states (it prefills the suffix only).
Interleaved rounds, the best of each, GPU work waited for. One JSON line; runs on CPU at small sizes (the test does).

    python benchmarks/gpu_hit_ttft.py --size small --prefix 32768 --suffix 64 --rounds 10
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
from serve_accelerate import SIZES
from transformers import DynamicCache, Qwen3_5ForCausalLM

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.demo import tiny_hybrid_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 50281


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--prefix", type=int, default=32768, help="cached prompt tokens")
    parser.add_argument("--suffix", type=int, default=64, help="new prompt tokens after the cached ones")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if min(args.prefix, args.suffix, args.rounds) < 1:
        parser.error("--prefix, --suffix and --rounds must be at least 1")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    config = tiny_hybrid_config(VOCAB, max_position_embeddings=args.prefix + args.suffix + 8, **SIZES[args.size])
    model = Qwen3_5ForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype]).eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB - 1, (1, args.prefix), generator=gen).to(device)

    def prompt() -> torch.Tensor:  # the prefix and a fresh suffix
        return torch.cat([prefix, torch.randint(3, VOCAB - 1, (1, args.suffix), generator=gen).to(device)], 1)

    def timed(run) -> float:
        sync()
        start = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - start

    store = PrefixStore(model, capacity="64GiB", policy="dp")
    with torch.inference_mode():
        for _ in range(3):  # the second request records the branch point, the third hits it
            model.generate(prompt(), past_key_values=HybridPrefixCache(store), max_new_tokens=1, pad_token_id=0)
        store.flush()
        ready = DynamicCache(config=model.config)  # the state the hits resume from, held by a plain cache
        model(input_ids=prefix, past_key_values=ready, logits_to_keep=1)
        reused, hits, floors = [], [], []
        for _ in range(args.rounds):  # interleaved, so the machine's state hits both alike
            cache = HybridPrefixCache(store)
            request = prompt()
            hits.append(timed(lambda c=cache, r=request: model.generate(r, past_key_values=c, max_new_tokens=1,
                                                                         pad_token_id=0)))
            reused.append(cache.reused_tokens)
            store.flush()  # admission happens after the response, not in the next request's TTFT
            plain, request = copy.deepcopy(ready), prompt()
            floors.append(timed(lambda c=plain, r=request: model.generate(r, past_key_values=c, max_new_tokens=1,
                                                                           pad_token_id=0)))
    row = dict(device=str(device), size=args.size, dtype=args.dtype, prefix=args.prefix, suffix=args.suffix,
               rounds=args.rounds, reused_tokens=min(reused), hit_ms=min(hits) * 1e3, floor_ms=min(floors) * 1e3,
               hit_median_ms=sorted(hits)[args.rounds // 2] * 1e3,
               floor_median_ms=sorted(floors)[args.rounds // 2] * 1e3)
    row["ratio"] = row["hit_ms"] / row["floor_ms"]
    print(json.dumps(row))
    return 0 if min(reused) == args.prefix else 1  # every hit must have resumed at the whole prefix


if __name__ == "__main__":
    sys.exit(main())
