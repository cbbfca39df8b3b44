"""`prefixlab bench recurrent`: capture overhead, and our kernels vs transformers' torch paths on the same inputs.

Every ratio is measured within one run with interleaved repeats (A, B, A, B, ...) and the best time of each, so
load from other processes hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from prefixlab.bench import check_device, check_sizes
from prefixlab.bench.hydragen import DTYPES
from prefixlab.errors import InvalidInputError
from prefixlab.recurrent.delta_rule import fla_unsupported, gated_delta_rule
from prefixlab.recurrent.dispatch import resolve_backend, triton_dtype_unsupported
from prefixlab.recurrent.hf_reference import hf_chunk_gated_delta_rule, hf_mamba2_chunk_scan
from prefixlab.recurrent.inputs import delta_rule_inputs, ssd_inputs
from prefixlab.recurrent.ssd import ssd

# "cpu": this process's CPU seconds, which other processes' load hardly moves (with --threads 1, the work itself)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_times_s(fns: dict[str, Callable[[], object]], repeats: int, clock: str = "wall") -> dict[str, float]:
    """Best time in seconds (`clock`: CLOCKS) of each fn over `repeats` interleaved runs, after one warm-up run each
    (GPU work waited for: CUDA launches return before the kernels finish)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    now = CLOCKS[clock]
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = now()
            fn()
            sync()
            best[name] = min(best[name], now() - start)
    return best


def _on(inputs: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype)
            for name, tensor in inputs.items()}


def _ran(backend: str, device: str, cuda_package: str, dtype: torch.dtype, tokens: int | None = None) -> str:
    """The backend `backend` resolves to on `tokens` inputs ('auto' -> fla / mamba_ssm / torch, or naive for one
    token, as the kernels resolve it)."""
    unsupported = fla_unsupported(dtype, False) if cuda_package == "fla" else triton_dtype_unsupported(dtype)
    return resolve_backend(backend, torch.device(device), cuda_package, unsupported, tokens=tokens)


def spread_positions(length: int, count: int) -> tuple[int, ...]:
    """`count` capture positions ending each 1/count of the sequence, one token early so none is chunk-aligned."""
    return tuple(i * length // count - 1 for i in range(1, count + 1))


@torch.no_grad()
def capture_overhead(length: int, heads: int, dim: int, captures: int, repeats: int, backend: str,
                     device: str = "cpu", dtype: torch.dtype = torch.float32, clock: str = "wall") -> dict:
    """Prefill capturing `captures` states vs the same prefill returning only the final state."""
    inputs = _on(delta_rule_inputs(1, length, heads, heads, dim, dim), device, dtype)
    positions = spread_positions(length, captures)
    times = best_times_s(
        {
            "final_only": lambda: gated_delta_rule(**inputs, use_qk_l2norm=True, backend=backend),
            "with_captures": lambda: gated_delta_rule(**inputs, capture=positions, use_qk_l2norm=True, backend=backend),
        },
        repeats,
        clock,
    )
    return {"bench": "capture_overhead", "length": length, "heads": heads, "dim_k": dim, "dim_v": dim,
            "captures": captures, "backend": _ran(backend, device, "fla", dtype, length), "device": device,
            "clock": clock,
            "dtype": str(dtype).removeprefix("torch."), **_ms(times),
            "overhead": times["with_captures"] / times["final_only"] - 1.0}  # fmt: skip


@torch.no_grad()
def delta_rule_vs_transformers(length: int, heads: int, dim: int, repeats: int, backend: str,
                               device: str = "cpu", dtype: torch.dtype = torch.float32, clock: str = "wall") -> dict:
    """gated_delta_rule vs transformers' torch_chunk_gated_delta_rule (chunk 64, l2norm in kernel, final state)."""
    inputs = _on(delta_rule_inputs(1, length, heads, heads, dim, dim), device, dtype)
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    times = best_times_s(
        {
            "transformers": lambda: hf_chunk_gated_delta_rule(
                q, k, v, g=g, beta=beta, chunk_size=64, output_final_state=True, use_qk_l2norm_in_kernel=True
            ),
            "prefixlab": lambda: gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm=True, backend=backend),
        },
        repeats,
        clock,
    )
    return {"bench": "gated_delta_rule_vs_transformers", "length": length, "heads": heads, "dim_k": dim,
            "dim_v": dim, "backend": _ran(backend, device, "fla", dtype, length), "device": device, "clock": clock,
            "dtype": str(dtype).removeprefix("torch."), **_ms(times),
            "speedup": times["transformers"] / times["prefixlab"]}  # fmt: skip


@torch.no_grad()
def ssd_vs_transformers(length: int, heads: int, head_dim: int, state_size: int, repeats: int, backend: str,
                        device: str = "cpu", dtype: torch.dtype = torch.float32, clock: str = "wall") -> dict:
    """ssd vs transformers' mamba2 torch path (mamba2_chunk_scan, chunk 256, final state), one group."""
    inputs = _on(ssd_inputs(1, length, heads, head_dim, 1, state_size), device, dtype)
    x, dt, A, B, C, D, dt_bias = (inputs[name] for name in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    times = best_times_s(
        {
            "transformers": lambda: hf_mamba2_chunk_scan(
                x, dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True
            ),
            "prefixlab": lambda: ssd(x, dt, A, B, C, D=D, dt_bias=dt_bias, chunk_size=256, backend=backend),
        },
        repeats,
        clock,
    )
    return {"bench": "ssd_vs_transformers", "length": length, "heads": heads, "head_dim": head_dim,
            "state_size": state_size, "backend": _ran(backend, device, "mamba_ssm", dtype, length), "device": device,
            "clock": clock,
            "dtype": str(dtype).removeprefix("torch."), **_ms(times),
            "speedup": times["transformers"] / times["prefixlab"]}  # fmt: skip


def _ms(times_s: dict[str, float]) -> dict[str, float]:
    return {f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in times_s.items()}


def run(args: argparse.Namespace) -> int:
    check_sizes(length=args.length, heads=args.heads, dim=args.dim, captures=args.captures, ssd_heads=args.ssd_heads,
                ssd_head_dim=args.ssd_head_dim, ssd_state=args.ssd_state, repeats=args.repeats)
    if args.captures > args.length:
        raise InvalidInputError(f"--captures={args.captures} must not exceed --length={args.length} (one state a "
                                "position at most)")
    if args.threads < 0:
        raise InvalidInputError(f"--threads={args.threads} must be >= 0 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = str(check_device(args.device)), DTYPES[args.dtype]
    if args.clock == "cpu" and device != "cpu":
        raise InvalidInputError("--clock cpu times CPU work; on a GPU use --clock wall (kernels run asynchronously)")
    _ran(args.backend, device, "fla", dtype)  # a backend these inputs cannot take: say so before any work
    ssd_backend = args.backend if args.backend != "fla" else "auto"  # fla has no SSD kernel: mamba_ssm when there
    benches = [
        lambda: capture_overhead(args.length, args.heads, args.dim, args.captures, args.repeats, args.backend, device,
                                 dtype, args.clock),
        lambda: delta_rule_vs_transformers(args.length, args.heads, args.dim, args.repeats, args.backend, device,
                                           dtype, args.clock),
        lambda: ssd_vs_transformers(args.length, args.ssd_heads, args.ssd_head_dim, args.ssd_state, args.repeats,
                                    ssd_backend, device, dtype, args.clock),
    ]  # fmt: skip
    for bench in benches:  # each printed when done: a run stopped at a time limit keeps what it measured
        result = bench()
        print(json.dumps(result) if args.json else _describe(result), flush=True)
    return 0


def _describe(result: dict) -> str:
    fields = ", ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in result.items() if key != "bench")  # fmt: skip
    return f"{result['bench']}: {fields}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "recurrent", help="capture overhead and speed of the recurrent kernels vs transformers' torch paths"
    )
    parser.add_argument("--length", type=int, default=4096, help="prefill tokens (default 4096)")
    parser.add_argument("--heads", type=int, default=16, help="delta-rule heads (Qwen3.5: 16)")
    parser.add_argument("--dim", type=int, default=128, help="delta-rule d_k = d_v (Qwen3.5: 128)")
    parser.add_argument("--captures", type=int, default=8, help="states captured in the overhead benchmark")
    parser.add_argument("--ssd-heads", type=int, default=32, help="SSD heads")
    parser.add_argument("--ssd-head-dim", type=int, default=64, help="SSD head dim")
    parser.add_argument("--ssd-state", type=int, default=128, help="SSD state size")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs; the best of each counts")
    parser.add_argument("--backend", default="compiled",
                        help="prefixlab backend to time: naive, torch (chunked), compiled (the default), auto (fla / "
                        "mamba_ssm on CUDA where installed) or fla (times the delta rule, the SSD then runs auto)")
    parser.add_argument("--device", default="cpu", help="cpu (the default) or cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="inputs' dtype (default fp32; the fla backend: bf16 / fp16)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="wall seconds, or this process's "
                        "CPU seconds (cpu: other processes' load hardly moves it; the work itself with --threads 1)")
    parser.add_argument("--json", action="store_true", help="one JSON object per benchmark")
    parser.set_defaults(func=run)
