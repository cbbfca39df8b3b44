"""torch.compile with a way out: where this machine's compiler fails on a function, or (checked devices) returns
what the function itself does not, run it uncompiled."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves


def compile_or_eager(fn: Callable, what: str, *, check_devices: tuple[str, ...] = (), **options) -> Callable:
    """torch.compile(fn, **options), except that a compile failure (inductor has failed on some shapes: on an H200
    with torch 2.11, the SSD chunk scan at 8192 tokens and FlexAttention's decoding template with a dynamic key
    length) warns once and runs `fn` itself from then on: the same arithmetic, uncompiled. Errors of prefixlab's own
    raised inside the compiled code (bad input, a stop request) pass through unchanged.

    `check_devices`: on these device types a call that compiled (or loaded from inductor's cache) a graph also runs
    `fn` uncompiled and compares; a compiled result that is not close (torch 2.13's CPU FlexAttention template
    returns wrong values or NaN at small shapes in AVX2 code; inductor's cache reused after ATEN_CPU_CAPABILITY
    changed returns garbage) warns, and inputs of that signature (shapes, dtypes) run uncompiled from then on.

    Past dynamo's recompile limit (torch._dynamo.config.recompile_limit graphs of `fn`), which fullgraph=True makes
    an error, inputs no compiled graph takes run uncompiled (warned once); the graphs compiled so far still run."""
    from torch._dynamo import exc

    # FailOnRecompileLimitHit was FailOnCacheLimitHit before torch 2.6
    limit_hit = getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit", ())
    compiled_fn = torch.compile(fn, **options)
    failed: list[str] = []
    at_limit: list[str] = []
    wrong: set[tuple] = set()  # input signatures whose compiled results were wrong

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if failed:
            return fn(*args, **kwargs)
        checked = bool(check_devices) and _device_type(args, kwargs) in check_devices
        if checked and wrong and _signature(args, kwargs) in wrong:  # (the signature only once one was wrong)
            return fn(*args, **kwargs)
        graphs = _graphs_compiled() if checked else 0
        try:
            out = compiled_fn(*args, **kwargs)
        except limit_hit:
            if not at_limit:
                at_limit.append(what)
                warnings.warn(f"prefixlab: torch.compile reached its recompile limit on {what}; inputs of new shapes "
                              "run uncompiled (same results, slower; raise torch._dynamo.config.recompile_limit to "
                              "compile more)", RuntimeWarning, stacklevel=2)  # fmt: skip
            return fn(*args, **kwargs)
        except exc.BackendCompilerFailed as err:
            inner = getattr(err, "inner_exception", None)
            if inner is not None and type(inner).__module__.startswith("prefixlab"):
                raise inner from None
            failed.append(f"{type(inner or err).__name__}: {inner or err}".splitlines()[0][:200])
            warnings.warn(f"prefixlab: torch.compile failed on {what} ({failed[0]}); running it uncompiled from now "
                          "on (same results, slower)", RuntimeWarning, stacklevel=2)
            return fn(*args, **kwargs)
        except Exception as err:  # a compiled kernel that crashes where `fn` runs (checked devices)
            if not checked or type(err).__module__.startswith("prefixlab"):
                raise
            want = _reference(fn, args, kwargs)  # raises what `fn` raises on these inputs, if anything
            why = f"it raised {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            return _wrong(_signature(args, kwargs), why, want)
        if not checked or _graphs_compiled() == graphs:  # unchecked, or a graph checked when it was compiled
            return out
        want = _reference(fn, args, kwargs)
        mismatch = _mismatch(out, want)
        return out if mismatch is None else _wrong(_signature(args, kwargs), mismatch, want)

    def _wrong(key: tuple, why: str, want: object) -> object:
        wrong.add(key)
        run.wrong_results.append(f"{key}: {why}")
        warnings.warn(f"prefixlab: torch.compile gave wrong results on {what} ({why}); running these shapes "
                      "uncompiled from now on (same results as the reference, slower)", RuntimeWarning, stacklevel=3)
        return want

    run.compile_failed = failed  # what failed, for tests and reports
    run.wrong_results = []  # the checked signatures whose compiled results were wrong
    return run


def _reference(fn: Callable, args: tuple, kwargs: dict) -> object:
    """`fn` run uncompiled to check a compiled result: without the warning FlexAttention gives when it runs
    uncompiled (this run is uncompiled on purpose; the compiled one is what the caller gets)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".* called without torch\.compile")
        return fn(*args, **kwargs)


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (a cache hit of inductor's counts: dynamo traces it anew)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _device_type(args: tuple, kwargs: dict) -> str | None:
    for leaf in itertools.chain(args, kwargs.values()):  # a top-level tensor, without flattening (hot path)
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return next((leaf.device.type for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)), None)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a static-shape compile specialises on: tensors' shapes and dtypes, other leaves' types and values."""
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor)
                 else leaf if isinstance(leaf, int | float | bool | str | None) else type(leaf).__name__
                 for leaf in tree_leaves((args, kwargs)))


def _mismatch(got: object, want: object) -> str | None:
    """None if every tensor of `got` is close to `want`'s (NaN where it is NaN), else what differs. The tolerance
    is loose (1e-3 of the values' scale in float32, 3e-2 in 16-bit types): it tells a kernel's rounding from a
    wrong kernel, whose errors seen so far are of the values' size or NaN."""
    got_leaves, want_leaves = tree_leaves(got), tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs against {len(want_leaves)}"
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if not isinstance(b, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return f"shape {getattr(a, 'shape', None)} against {tuple(b.shape)}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return "integer outputs differ"
            continue
        tol = 1e-3 if min(a.dtype.itemsize, b.dtype.itemsize) >= 4 else 3e-2
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return "NaN where the uncompiled function has none" if a.isnan().any() else "NaN missing"
        finite = ~b.isnan()
        tol *= max(1.0, b[finite].abs().max().item()) if finite.any() else 1.0
        error = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
        if not error <= tol:
            return f"max |compiled - uncompiled| {error:.3g} > {tol:.3g}"
    return None
