"""`prefixlab bench <what>`: micro-benchmarks that print what they measured (see benchmarks/RESULTS.md)."""

from __future__ import annotations

import argparse
import importlib

# module path -> defines `register(subparsers)` adding `bench <name>` with `set_defaults(func=...)`.
BENCH_MODULES = ("prefixlab.bench.hydragen", "prefixlab.bench.recurrent")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="micro-benchmarks (hydragen, recurrent)")
    which = bench.add_subparsers(dest="bench", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(which)
