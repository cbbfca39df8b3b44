"""torch.compile with a way out: where this machine's compiler fails on a function, run it uncompiled."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch


def compile_or_eager(fn: Callable, what: str, **options) -> Callable:
    """torch.compile(fn, **options), except that a compile failure (inductor has failed on some shapes: on an H200
    with torch 2.11, the SSD chunk scan at 8192 tokens and FlexAttention's decoding template with a dynamic key
    length) warns once and runs `fn` itself from then on: the same arithmetic, uncompiled. Errors of prefixlab's own
    raised inside the compiled code (bad input, a stop request) pass through unchanged."""
    from torch._dynamo.exc import BackendCompilerFailed

    compiled_fn = torch.compile(fn, **options)
    failed: list[str] = []

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if failed:
            return fn(*args, **kwargs)
        try:
            return compiled_fn(*args, **kwargs)
        except BackendCompilerFailed as err:
            inner = getattr(err, "inner_exception", None)
            if inner is not None and type(inner).__module__.startswith("prefixlab"):
                raise inner from None
            failed.append(f"{type(inner or err).__name__}: {inner or err}".splitlines()[0][:200])
            warnings.warn(f"prefixlab: torch.compile failed on {what} ({failed[0]}); running it uncompiled from now "
                          "on (same results, slower)", RuntimeWarning, stacklevel=2)
            return fn(*args, **kwargs)

    run.compile_failed = failed  # what failed, for tests and reports
    return run
