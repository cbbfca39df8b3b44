"""A left-padded batch of rows under one cached prompt (session 32's priming, prefixlab/cache/align.py), on a GPU.

Rows of different lengths hold the cached prompt's checkpoint at different padded columns. Three ways to serve the
same kind of batch, each checked token for token against plain generate() of the same batch:
  plain     generate() with transformers' own cache (prefills every row whole, batched)
  primed    through the store: the rows are prefilled from the cached prompt up to the batch's deepest column
            (together, right-padded, since session 35; one by one before), then the batch resumes there (the default)
  unprimed  through the store with priming switched off: the batch resumes at one column, where few rows hold
            the prompt's checkpoint, so most rows drop to an earlier common checkpoint (rows_reused_unprimed)
Each round serves fresh questions (a served batch is admitted, which would let the next one hit its rows), rounds
interleaved, GPU work waited for. One JSON line.

    python benchmarks/gpu_padded_batch.py --size small --prefix 4096 --rows 8 --rounds 3 [--profile 15]

`primes_ms`: the primes' part of the primed batch, per timed round (0 where the batch was not primed).
Session 33 (one H100, bf16): primed 0.94x plain, unprimed 0.92x; `--profile` prints where each kind spends its
device and host time, for the next GPU session.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from gpu_hit_ttft import VOCAB
from serve_accelerate import SIZES
from transformers import Qwen3_5ForCausalLM

import prefixlab.cache.hooks as hooks
from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.bench.hydragen import DTYPES
from prefixlab.demo import tiny_hybrid_config


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, length - len(row):], mask[b, length - len(row):] = row, 1
    return ids, mask


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--prefix", type=int, default=4096, help="the cached prompt's tokens")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--question", type=int, default=16, help="row b's question has question * (b + 1) tokens")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", type=int, default=0, help="then profile one batch of each kind: table rows")
    args = parser.parse_args()
    if min(args.prefix, args.rows - 1, args.question, args.new_tokens, args.rounds) < 1:
        parser.error("--prefix, --question, --new-tokens and --rounds must be at least 1, --rows at least 2")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    longest = args.prefix + args.question * args.rows + args.new_tokens + 8
    config = tiny_hybrid_config(VOCAB, max_position_embeddings=longest, **SIZES[args.size])
    model = Qwen3_5ForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype]).eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB - 1, (args.prefix,), generator=gen)
    store = PrefixStore(model, capacity="64GiB", policy="dp")
    prime_rows = hooks.prime_rows

    def batch() -> list[torch.Tensor]:
        return [torch.cat([prefix, torch.randint(3, VOCAB - 1, (args.question * (b + 1),), generator=gen)])
                for b in range(args.rows)]

    prime_seconds: list[float] = []
    priming = [False]  # (a prime's own forward calls the hook again: only the batch's call is timed)

    def timed_prime_rows(*args, **kwargs) -> None:  # the primes' share of a primed batch
        if priming[0]:
            return prime_rows(*args, **kwargs)
        sync()
        started, priming[0] = time.perf_counter(), True
        try:
            prime_rows(*args, **kwargs)
        finally:
            priming[0] = False
        sync()
        prime_seconds.append(time.perf_counter() - started)

    def serve(kind: str, rows: list[torch.Tensor]) -> tuple[torch.Tensor, float, list[int]]:
        ids, mask = (t.to(device) for t in left_padded(rows))
        cache = None if kind == "plain" else HybridPrefixCache(store)
        hooks.prime_rows = timed_prime_rows if kind == "primed" else (lambda *a, **k: None)
        sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=args.new_tokens,
                             do_sample=False, pad_token_id=0)
        sync()
        seconds = time.perf_counter() - start
        store.flush()  # admission after the response, outside the next batch's clock
        return out[:, ids.shape[1]:].cpu(), seconds, cache.rows_reused if cache is not None else []

    with torch.inference_mode():
        for _ in range(3):  # the prompt's branch point: the second request records it, the third hits it
            serve("primed", [torch.cat([prefix, torch.randint(3, VOCAB - 1, (16,), generator=gen)])])
        prime_seconds.clear()  # (single rows: nothing to prime)
        seconds = {kind: [] for kind in ("plain", "primed", "unprimed", "plain_for_unprimed")}
        reused, identical = {}, True
        for _ in range(args.rounds + 1):  # the first round warms up (allocator, kernels) and is not timed
            for kind in ("primed", "unprimed"):
                rows = batch()
                expected, plain_s, _ = serve("plain", rows)
                got, cached_s, reused[kind] = serve(kind, rows)
                identical &= torch.equal(got, expected)
                seconds["plain" if kind == "primed" else "plain_for_unprimed"].append(plain_s)
                seconds[kind].append(cached_s)
        if args.profile:  # where one batch of each kind spends its device and host time
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            for kind in ("plain", "unprimed", "primed"):
                with torch.profiler.profile(activities=activities) as prof:
                    serve(kind, batch())
                for key in ("self_cuda_time_total", "self_cpu_time_total")[device.type != "cuda":]:
                    print(f"--- {kind}, by {key}")
                    print(prof.key_averages().table(sort_by=key, row_limit=args.profile, max_name_column_width=60))
        hooks.prime_rows = prime_rows
    best = {kind: min(times[1:]) * 1e3 for kind, times in seconds.items()}
    row = dict(device=str(device), size=args.size, dtype=args.dtype, prefix=args.prefix, rows=args.rows,
               question_tokens=[args.question * (b + 1) for b in range(args.rows)], new_tokens=args.new_tokens,
               rounds=args.rounds, rows_reused_primed=reused["primed"], rows_reused_unprimed=reused["unprimed"],
               tokens_identical=identical, **{f"{kind}_ms": ms for kind, ms in best.items()},
               primes_ms=[seconds * 1e3 for seconds in prime_seconds[1:args.rounds + 1]],
               primed_vs_plain=best["plain"] / best["primed"],
               unprimed_vs_plain=best["plain_for_unprimed"] / best["unprimed"])
    print(json.dumps(row))
    return 0 if identical or args.dtype != "fp32" else 1  # bf16 may differ from plain by rounding (reported)


if __name__ == "__main__":
    sys.exit(main())
