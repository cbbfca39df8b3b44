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
from prefixlab.bench.hydragen import DTYPES
from prefixlab.demo import tiny_hybrid_config

VOCAB = 50281


def hit_and_floor_seconds(model, store: PrefixStore, prefix: torch.Tensor, new_suffix, rounds: int,
                          sync=lambda: None) -> tuple[list[int], list[float], list[float]]:
    """(tokens each hit reused, hit seconds, floor seconds) over `rounds` interleaved rounds (the machine's state hits
    both alike): generate() of prefix + new_suffix() through `store` vs from a plain cache already holding the
    prefix. First primes the store: the second request records the branch point, the third hits it."""
    def timed(run) -> float:
        sync()
        start = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - start

    def first_token(ids: torch.Tensor, cache) -> None:
        model.generate(ids, past_key_values=cache, max_new_tokens=1, pad_token_id=0)

    with torch.inference_mode():
        for _ in range(3):
            first_token(torch.cat([prefix, new_suffix()], 1), HybridPrefixCache(store))
        store.flush()
        ready = DynamicCache(config=model.config)  # the state the hits resume from, held by a plain cache
        model(input_ids=prefix, past_key_values=ready, logits_to_keep=1)
        reused, hits, floors = [], [], []
        for _ in range(rounds):
            cache, ids = HybridPrefixCache(store), torch.cat([prefix, new_suffix()], 1)
            hits.append(timed(lambda c=cache, i=ids: first_token(i, c)))
            reused.append(cache.reused_tokens)
            store.flush()  # admission happens after the response, not in the next request's TTFT
            # generate() slices the prompt by the cache length: from the ready cache it runs the suffix only
            plain, ids = copy.deepcopy(ready), torch.cat([prefix, new_suffix()], 1)
            floors.append(timed(lambda c=plain, i=ids: first_token(i, c)))
    return reused, hits, floors


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
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: this machine has no CUDA device; use --device cpu")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    config = tiny_hybrid_config(VOCAB, max_position_embeddings=args.prefix + args.suffix + 8, **SIZES[args.size])
    model = Qwen3_5ForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype]).eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB - 1, (1, args.prefix), generator=gen).to(device)

    def new_suffix() -> torch.Tensor:
        return torch.randint(3, VOCAB - 1, (1, args.suffix), generator=gen).to(device)

    store = PrefixStore(model, capacity="64GiB", policy="dp")
    reused, hits, floors = hit_and_floor_seconds(model, store, prefix, new_suffix, args.rounds, sync)
    row = dict(device=str(device), size=args.size, dtype=args.dtype, prefix=args.prefix, suffix=args.suffix,
               rounds=args.rounds, reused_tokens=min(reused), hit_ms=min(hits) * 1e3, floor_ms=min(floors) * 1e3,
               hit_median_ms=sorted(hits)[args.rounds // 2] * 1e3,
               floor_median_ms=sorted(floors)[args.rounds // 2] * 1e3)
    row["ratio"] = row["hit_ms"] / row["floor_ms"]
    print(json.dumps(row))
    return 0 if min(reused) == args.prefix else 1  # every hit must have resumed at the whole prefix


if __name__ == "__main__":
    sys.exit(main())
