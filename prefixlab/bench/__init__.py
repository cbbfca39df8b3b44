"""`prefixlab bench <what>`: micro-benchmarks that print what they measured (see benchmarks/RESULTS.md)."""

from __future__ import annotations

import argparse
import importlib

from prefixlab.errors import InvalidInputError

# module path -> defines `register(subparsers)` adding `bench <name>` with `set_defaults(func=...)`.
BENCH_MODULES = ("prefixlab.bench.hydragen", "prefixlab.bench.recurrent")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="micro-benchmarks (hydragen, recurrent)")
    which = bench.add_subparsers(dest="bench", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(which)


def check_sizes(**sizes: int) -> None:
    """InvalidInputError naming the first `--name` below 1."""
    for name, value in sizes.items():
        if value < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')}={value} must be at least 1")


def wall_clock_note() -> str:
    """For a wall-clock bar's failure message: the machine's load, since other jobs on a shared machine slow one path
    more than the other (`make bench`'s decode-step and hit-TTFT bars failed at load 5-7 on 2 cores, passed at 2)."""
    import os

    return (f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; a wall-clock bar: rerun on a quieter "
            "machine before reading it as a regression")


def check_device(name: str):
    """`name` as a torch.device this machine has, cpu or cuda, else InvalidInputError saying which it has."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidInputError(f"--device {name!r} is not a torch device name; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):  # meta tensors hold no data: it would time nothing
        raise InvalidInputError(f"--device {name!r}: the benchmarks run on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"--device {name!r}: this machine has no CUDA device; use --device cpu")
    return device
