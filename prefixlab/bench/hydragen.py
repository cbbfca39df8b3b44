"""`prefixlab bench hydragen`: Hydragen attention vs SDPA over materialised per-sequence KV; `--e2e` for generate.

    prefixlab bench hydragen --batch 64 --prefix 4096 --suffix 128 --json
    prefixlab bench hydragen --batch 64,256,1024 --prefix 4096,16384 --json --plot sweep.png   (the paper's sweep)
    prefixlab bench hydragen --e2e --model llama --completions 64 --prompt 2048 --new-tokens 32 --json
    prefixlab bench hydragen --e2e --device cuda --dtype bf16 --completions 512 --prompt 16384 --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from prefixlab.attention.api import hydragen_attention
from prefixlab.attention.kernels import active_cuda_lse_kernels
from prefixlab.attention.packed import packed_compile_failed
from prefixlab.attention.reference import causal_suffix_mask
from prefixlab.attention.tree import SharedLevel
from prefixlab.bench import check_device, check_sizes
from prefixlab.errors import InvalidInputError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Best (minimum) wall time of `fn` in ms over `repeats` runs, after `warmup` untimed calls (which absorb
    compiles). The minimum, because on a shared machine the other runs measure the neighbours' load."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def cuda_graph_replay(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
    """fn captured in a CUDA graph, as serving engines replay their decode steps (no host work per call): returns
    (replay, the graph's output tensor). Warmed up on a side stream first, as torch.cuda.graph requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def attention_case(batch: int, prefix: int, suffix: int, q_heads: int = 8, kv_heads: int = 1, head_dim: int = 128,
                   queries: int = 1, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """Random decode (queries=1) or prefill inputs: q, the shared prefix level, per-sequence suffix KV."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return (rand(batch, q_heads, queries, head_dim), SharedLevel(rand(kv_heads, prefix, head_dim),
            rand(kv_heads, prefix, head_dim)), rand(batch, kv_heads, suffix, head_dim),
            rand(batch, kv_heads, suffix, head_dim))


def bench_attention(batch: int, prefix: int, suffix: int, q_heads: int = 8, kv_heads: int = 1, head_dim: int = 128,
                    queries: int = 1, dtype: str = "fp32", device: str = "cpu", repeats: int = 10,
                    packed: bool = True) -> dict:
    """Times SDPA over each sequence's full KV (materialised before timing), split and packed Hydragen."""
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    check_sizes(batch=batch, prefix=prefix, suffix=suffix, queries=queries, repeats=repeats, q_heads=q_heads,
                kv_heads=kv_heads, head_dim=head_dim)
    if q_heads % kv_heads:
        raise InvalidInputError(f"--q-heads={q_heads} must be a multiple of --kv-heads={kv_heads} (grouped queries)")
    device = str(check_device(device))
    if queries > suffix:
        raise InvalidInputError(f"--queries={queries} must not exceed --suffix={suffix} (queries are suffix tokens)")
    q, level, suffix_k, suffix_v = attention_case(batch, prefix, suffix, q_heads, kv_heads, head_dim, queries,
                                                  DTYPES[dtype], device)
    # what a standard cache holds: every sequence's own copy of the prefix
    full_k = torch.cat([level.keys.expand(batch, -1, -1, -1), suffix_k], dim=2).contiguous()
    full_v = torch.cat([level.values.expand(batch, -1, -1, -1), suffix_v], dim=2).contiguous()
    mask = None
    if queries > 1:
        mask = torch.cat([torch.ones(queries, prefix, dtype=torch.bool, device=device),
                          causal_suffix_mask(queries, suffix, torch.device(device))], dim=1)
    result = dict(batch=batch, prefix=prefix, suffix=suffix, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                  queries=queries, dtype=dtype, device=str(q.device), threads=torch.get_num_threads(),
                  lse_kernels=active_cuda_lse_kernels() if q.device.type == "cuda" else None)
    result["sdpa_ms"] = time_ms(
        lambda: F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask, enable_gqa=True), repeats)
    split = lambda: hydragen_attention(q, [level], suffix_k, suffix_v, method="split")  # noqa: E731
    result["split_ms"] = time_ms(split, repeats)
    result["split_graph_ms"] = result["split_graph_error"] = result["split_graph_max_diff"] = None
    if q.device.type == "cuda":  # split's kernels without its host time (it is launch-bound at decode)
        try:
            replay, out = cuda_graph_replay(split)
            result["split_graph_ms"] = time_ms(replay, repeats)
            result["split_graph_max_diff"] = (out.float() - split().float()).abs().max().item()
        except Exception as error:  # noqa: BLE001 - reported, not fatal: the other timings stand
            result["split_graph_error"] = f"{type(error).__name__}: {error}"[:300]
    result["packed_ms"] = result["packed_compile_failed"] = None
    if packed:
        result["packed_ms"] = time_ms(lambda: hydragen_attention(q, [level], suffix_k, suffix_v, method="packed"),
                                      repeats)
        # where torch.compile failed on these shapes, packed_ms timed uncompiled FlexAttention: say so
        result["packed_compile_failed"] = packed_compile_failed(q.device.type)
    best = min(t for t in (result["split_ms"], result["packed_ms"]) if t is not None)
    result["best"] = "split" if best == result["split_ms"] else "packed"
    result["speedup"] = result["sdpa_ms"] / best
    result["split_speedup"] = result["sdpa_ms"] / result["split_ms"]
    result["packed_speedup"] = result["sdpa_ms"] / result["packed_ms"] if packed else None
    graph_ms = result["split_graph_ms"]
    result["split_graph_speedup"] = result["sdpa_ms"] / graph_ms if graph_ms else None
    return result


def _format(result: dict) -> str:
    if "completions" in result:
        from prefixlab.bench.hydragen_e2e import format_e2e

        return format_e2e(result)
    packed = "n/a" if result["packed_ms"] is None else f"{result['packed_ms']:.2f} ms"
    graph = f"  split in a CUDA graph        {result['split_graph_ms']:.2f} ms\n" if result["split_graph_ms"] else ""
    return (
        f"hydragen attention  B={result['batch']} P={result['prefix']} S={result['suffix']} Tq={result['queries']} "
        f"heads {result['q_heads']}/{result['kv_heads']} d={result['head_dim']} {result['dtype']} on "
        f"{result['device']} ({result['threads']} threads)\n"
        f"  sdpa (full KV per sequence) {result['sdpa_ms']:.2f} ms\n"
        f"  split                       {result['split_ms']:.2f} ms\n"
        f"  packed                      {packed}\n"
        f"{graph}"
        f"  speedup sdpa/best ({result['best']}) {result['speedup']:.2f}x"
    )


def sizes_list(text: str, name: str) -> list[int]:
    """`--name 64` or `--name 64,256,1024`: the sizes of a sweep, each at least 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidInputError(f"--{name}={text!r} must be a whole number or a comma-separated list of them, "
                                f"e.g. --{name} 64,256") from None
    check_sizes(**{name: min(sizes)})
    return sizes


def plot_sweep(results: list[dict], path: str) -> None:
    """The Hydragen paper's figure: speed-up over SDPA vs batch, one line per prefix length (split eager, and split
    in a CUDA graph dashed where measured); written with the Agg canvas."""
    from matplotlib.figure import Figure

    from prefixlab.sim.report import check_plot_path, save_plot

    path = check_plot_path(path)
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot()
    for prefix in dict.fromkeys(r["prefix"] for r in results):
        mine = sorted((r["batch"], r["split_speedup"], r["split_graph_speedup"]) for r in results
                      if r["prefix"] == prefix)
        line, = axes.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", label=f"P={prefix}")
        graphed = [(m[0], m[2]) for m in mine if m[2] is not None]
        if graphed:
            axes.plot(*zip(*graphed, strict=True), marker="s", linestyle="--", color=line.get_color(),
                      label=f"P={prefix}, CUDA graph")
    axes.axhline(1.0, color="gray", linewidth=0.8)
    batches = sorted({r["batch"] for r in results})
    axes.set(xscale="log", xlabel="batch (sequences sharing the prefix)", ylabel="speed-up over SDPA (x)")
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.minorticks_off()
    axes.legend()
    save_plot(figure, path)


def _run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidInputError(f"--threads={args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    if args.e2e:
        from prefixlab.bench.hydragen_e2e import bench_e2e

        if args.plot:
            raise InvalidInputError("--plot draws the attention sweep (--batch / --prefix lists); drop it with --e2e")

        result = bench_e2e(args.model, args.completions, args.prompt, args.new_tokens, repeats=args.repeats,
                           device=args.device, dtype=args.dtype)
        print(json.dumps(result) if args.json else _format(result))
        return 0
    batches, prefixes = sizes_list(args.batch, "batch"), sizes_list(args.prefix, "prefix")
    if args.plot:
        from prefixlab.sim.report import check_plot_path

        check_plot_path(args.plot)  # before the sweep's time is spent
    results = []
    for prefix in prefixes:
        for batch in batches:
            result = bench_attention(batch, prefix, args.suffix, args.q_heads, args.kv_heads, args.head_dim,
                                     args.queries, args.dtype, args.device, args.repeats, packed=not args.no_packed)
            print(json.dumps(result) if args.json else _format(result), flush=True)
            results.append(result)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next point's materialised KV may need all of it
    if args.plot:
        plot_sweep(results, args.plot)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench hydragen`."""
    p = subparsers.add_parser("hydragen", help="Hydragen shared-prefix attention vs SDPA (and --e2e generate)")
    p.add_argument("--batch", default="64",
                   help="sequences sharing the prefix (default 64; a comma-separated list sweeps)")
    p.add_argument("--prefix", default="4096",
                   help="shared prefix tokens (default 4096; a comma-separated list sweeps)")
    p.add_argument("--suffix", type=int, default=128, help="per-sequence tokens after the prefix (default 128)")
    p.add_argument("--queries", type=int, default=1, help="query tokens per sequence (default 1 = decode)")
    p.add_argument("--q-heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads (default 1)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="default fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default cuda where available, else cpu")
    p.add_argument("--repeats", type=int, default=10, help="timed runs; the best is reported (default 10)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--no-packed", action="store_true", help="skip the packed path (its compile takes a while on CPU)")
    p.add_argument("--e2e", action="store_true",
                   help="end-to-end generate decode throughput of a model (--model) instead")
    p.add_argument("--model", default="llama", choices=("llama", "qwen3_5", "qwen3_5_4b"),
                   help="--e2e: a tiny architecture (default llama), or a ~4 B Qwen3.5-shaped hybrid (GPU)")
    p.add_argument("--completions", type=int, default=64, help="--e2e: num_return_sequences (default 64)")
    p.add_argument("--prompt", type=int, default=2048, help="--e2e: prompt tokens (default 2048)")
    p.add_argument("--new-tokens", type=int, default=32, help="--e2e: tokens generated per completion (default 32)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a line per point of a sweep)")
    p.add_argument("--plot", help="write speed-up vs batch, a line per prefix, to this .png/.pdf/.svg")
    p.set_defaults(func=_run)
