"""Helpers of the CUDA-backend tests: skips without a GPU / a package, and fake modules standing in for fla and
mamba_ssm (their published signatures) on a machine without them."""

import importlib.util
import sys
import types

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_package(name: str):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"needs the {name} package")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def install_fake_module(monkeypatch, dotted: str, **functions) -> None:
    """Make `import dotted` (and its parent packages) find a module holding `functions`, for this test only."""
    parts = dotted.split(".")
    for depth in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    module = types.ModuleType(dotted)
    for name, function in functions.items():
        setattr(module, name, function)
    monkeypatch.setitem(sys.modules, dotted, module)


# fla 0.6 computes the dot products of its fused triangular solve (gated delta rule and KDA chunk kernels) at a module
# constant, TF32 on sm80+ GPUs, which TRITON_F32_DEFAULT does not reach: the fp32 model then differs from itself by up
# to ~2e-3 in the logits when a prompt is cut elsewhere (OLMo-hybrid, whose beta reaches 2; benchmarks/RESULTS.md,
# GPU session 27, reproduced on the CPU through Triton's interpreter with TF32 rounding).
FLA_SOLVE_PRECISION_MODULES = ("fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.kda.chunk_intra")


def force_fla_ieee_solve() -> list[str]:
    """Set fla's fused-solve dot precision to IEEE fp32 where it is TF32 (call before fla's kernels first compile:
    Triton refuses a changed global afterwards). Returns the modules changed."""
    if importlib.util.find_spec("fla") is None:
        return []
    changed = []
    for name in FLA_SOLVE_PRECISION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another fla layout: nothing of this kind to change
            continue
        precision = getattr(module, "SOLVE_TRIL_DOT_PRECISION", None)
        if precision is not None and getattr(precision, "value", precision) != "ieee":
            module.SOLVE_TRIL_DOT_PRECISION = type(precision)("ieee")  # triton.language.constexpr("ieee")
            changed.append(name)
    return changed
