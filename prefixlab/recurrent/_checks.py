"""Input checks shared by the recurrent kernels: each failure is an InvalidInputError naming the argument."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from prefixlab.errors import InvalidInputError, is_int


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidInputError(message)


def check_tensor(name: str, tensor: object, shape: Sequence[int | None], *, floating: bool = True) -> torch.Tensor:
    """`tensor` is a torch.Tensor whose shape matches `shape` (None = any size on that dim)."""
    # Messages are formatted only on failure: these checks run in every patched layer's forward (decode steps too)
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or not all(s is None or s == d for s, d in zip(shape, tensor.shape, strict=True)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InvalidInputError(f"{name} has shape {list(tensor.shape)}, expected {expected}")
    if floating and not tensor.is_floating_point():
        raise InvalidInputError(f"{name} must be a floating point tensor, got {tensor.dtype}")
    return tensor


def check_same_device(named: dict[str, torch.Tensor | None]) -> torch.device:
    """All given tensors live on one device; returns it."""
    first_name = first = None
    for name, tensor in named.items():
        if tensor is None:
            continue
        if first is None:
            first_name, first = name, tensor
        elif tensor.device != first.device:
            raise InvalidInputError(
                f"{name} is on {tensor.device} but {first_name} is on {first.device}: move them to one device"
            )
    return first.device


def check_same_dtype(named: dict[str, torch.Tensor]) -> torch.dtype:
    first_name, first = next(iter(named.items()))
    for name, tensor in named.items():
        if tensor.dtype != first.dtype:
            raise InvalidInputError(
                f"{name} has dtype {tensor.dtype} but {first_name} has {first.dtype}: cast them to one dtype"
            )
    return first.dtype


def check_state(name: str, state: torch.Tensor | None, shape: Sequence[int], compute_dtype: torch.dtype) -> None:
    """A recurrent state has exactly `shape` and is float32 or the inputs' dtype (it is computed in float32)."""
    if state is None:
        return
    check_tensor(name, state, shape)
    if state.dtype != torch.float32 and state.dtype != compute_dtype:
        raise InvalidInputError(
            f"{name} has dtype {state.dtype}; pass it as torch.float32 (or the inputs' dtype {compute_dtype})"
        )


def check_capture(capture: Iterable[int], length: int, name: str = "capture") -> tuple[int, ...]:
    """Capture positions: sorted, distinct ints in [0, length] (p = state after the first p tokens). Integers of
    any kind (numpy's too) are taken and returned as Python ints."""
    if isinstance(capture, (str, bytes, torch.Tensor)) or not hasattr(capture, "__iter__"):
        raise InvalidInputError(f"{name} must be a sequence of ints, got {type(capture).__name__}")
    positions = tuple(capture)
    for p in positions:
        if not is_int(p):
            raise InvalidInputError(f"{name} must hold ints, got {p!r} ({type(p).__name__})")
        if not 0 <= p <= length:
            raise InvalidInputError(f"{name} position {p} is outside [0, {length}] for a call over {length} tokens")
    positions = tuple(int(p) for p in positions)
    if not all(a < b for a, b in zip(positions, positions[1:], strict=False)):
        raise InvalidInputError(f"{name} must be sorted and distinct, got {list(positions)}")
    return positions


def check_chunk_size(chunk_size: int) -> int:
    """A positive int (numpy integers included), as a Python int."""
    require(
        is_int(chunk_size) and chunk_size > 0,
        f"chunk_size must be a positive int, got {chunk_size!r}",
    )
    return int(chunk_size)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, without a .to() call when it is already: the kernels cast every input and output, and
    at a decode step's size a no-op .to() costs as much as the arithmetic."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
