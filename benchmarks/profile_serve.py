"""Where a request's time goes: `prefixlab run`'s per-prompt path vs a plain generate() loop, timed per request
(GPU work waited for) and profiled with torch.profiler. For GPU sessions (benchmarks/gpu_check.sh); runs on CPU too.

    python benchmarks/profile_serve.py --size small --requests 8 --prompt-tokens 2048 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import time

import torch
from serve_accelerate import SIZES, workload
from transformers import AutoModelForCausalLM

from prefixlab.cache.store import PrefixStore
from prefixlab.demo import tiny_hybrid_config
from prefixlab.fleet import serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--requests", type=int, default=8, help="questions over one system prompt")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rows", type=int, default=15, help="profiler table rows")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # the warm-up, the timed requests, then 3 the profile serves (not yet in the store: a new question each, as timed)
    vocab_size, _, records = workload(1, args.requests + 4, args.prompt_tokens, 40, 0)
    prompts, profiled = [r["input_ids"] for r in records[:-3]], [r["input_ids"] for r in records[-3:]]
    models = []
    for _ in range(2):  # the same weights twice: plain (transformers' layers) and prefixlab's (patched by the store)
        torch.manual_seed(0)
        config = tiny_hybrid_config(vocab_size, **SIZES[args.size])
        models.append(AutoModelForCausalLM.from_config(config).to(device).eval())
    plain, model = models
    store = PrefixStore(model, capacity="16GiB")
    paths = {"plain": lambda p: serve.generate_uncached(plain, p, args.max_new_tokens),
             "prefixlab": lambda p: serve.generate(model, store, p, args.max_new_tokens)[0]}
    with torch.inference_mode():
        for fn in paths.values():  # warm-up: allocations, the store's first entry
            fn(prompts[0])
        outputs, seconds = {}, {}
        for name, fn in paths.items():
            sync()
            started, outputs[name] = time.perf_counter(), []
            for p in prompts[1:]:
                outputs[name].append(fn(p))
            sync()
            seconds[name] = time.perf_counter() - started
        print(f"{device}: {args.requests} requests of {len(prompts[1])} tokens, {args.max_new_tokens} new: plain "
              f"{seconds['plain'] * 1e3 / args.requests:.1f} ms/request, prefixlab "
              f"{seconds['prefixlab'] * 1e3 / args.requests:.1f} ms/request, outputs identical "
              f"{outputs['plain'] == outputs['prefixlab']}, store {store.stats()['reused_tokens']} tokens reused")
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                             if device == "cuda" else [])
        for name, fn in paths.items():
            with torch.profiler.profile(activities=activities) as prof:
                for p in profiled:
                    fn(p)
                sync()
            key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(f"--- {name}, {len(profiled)} new requests, by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
            if device == "cuda":  # and where the host spent its time (launches, Python, waits)
                print(f"--- {name}, by self_cpu_time_total")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                max_name_column_width=60))


if __name__ == "__main__":
    main()
