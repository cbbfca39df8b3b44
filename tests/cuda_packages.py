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
