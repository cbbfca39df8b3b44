"""Backend choice (by the tensors' device, never by what is importable) and the torch.compile cache."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from prefixlab.compile import compile_or_eager
from prefixlab.errors import InvalidInputError
from prefixlab.recurrent._checks import require

PORTABLE_BACKENDS = ("naive", "torch", "compiled")


def resolve_backend(
    backend: str, device: torch.device, cuda_package: str, cuda_unsupported: str | None = None,
    tokens: int | None = None,
) -> str:
    """'auto' -> `cuda_package` for CUDA tensors when it is installed and can take these inputs (cuda_unsupported
    is None; else a reason), otherwise 'torch', or 'naive' for a call of at most one token (`tokens`, when given: a
    decode step, which a chunked kernel would pad to a whole chunk). Explicit names are checked and never silently
    replaced."""
    allowed = ("auto", *PORTABLE_BACKENDS, cuda_package)
    if backend not in allowed:
        raise InvalidInputError(f"backend must be one of {list(allowed)}, got {backend!r}")
    if backend == "auto":
        usable = device.type == "cuda" and cuda_unsupported is None and _installed(cuda_package)
        return cuda_package if usable else ("naive" if tokens is not None and tokens <= 1 else "torch")
    if backend == cuda_package:
        require(device.type == "cuda", f"backend={backend!r} needs CUDA tensors, got tensors on {device}")
        require(_installed(cuda_package), f"backend={backend!r} needs the {cuda_package} package: pip install it")
        require(cuda_unsupported is None, f"backend={backend!r} {cuda_unsupported}; use backend='torch'")
    return backend


def triton_dtype_unsupported(dtype: torch.dtype) -> str | None:
    """Why a CUDA package's Triton kernels should not take inputs of `dtype` (None: they can): Triton runs float32
    dot products at its default precision, TF32, not the float32 arithmetic asked for, unless
    `TRITON_F32_DEFAULT=ieee`. mamba_ssm's SSD kernels use that default; fla adds a rule of its own
    (`delta_rule.fla_unsupported`: its fused triangular solve is TF32 on sm80+ GPUs whatever the setting)."""
    if dtype in (torch.float16, torch.bfloat16):
        return None
    if dtype == torch.float32 and os.environ.get("TRITON_F32_DEFAULT") == "ieee":
        return None
    if dtype == torch.float32:
        return ("takes float32 only with TRITON_F32_DEFAULT=ieee set (else Triton computes float32 dot products in "
                "TF32)")
    return f"takes float16 / bfloat16, or float32 with TRITON_F32_DEFAULT=ieee; got {dtype}"


@functools.cache
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@functools.cache
def compiled(fn: Callable) -> Callable:
    """torch.compile(fn) made once per function; torch's own guards then recompile once per shape family
    (static first, then dynamic in the sequence length). A compile failure runs `fn` uncompiled (warned once); on
    CPU each compiled graph's first result is checked against `fn`'s (compile_or_eager's check_devices)."""
    return compile_or_eager(fn, f"the recurrent kernel's {fn.__name__}", fullgraph=True, check_devices=("cpu",))
