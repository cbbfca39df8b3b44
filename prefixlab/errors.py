"""Errors raised by prefixlab. Every message says what went wrong and what to do about it."""

import math
from numbers import Integral, Real

import numpy as np


def is_int(value: object) -> bool:
    """An integer argument: a Python or numpy integer (sizes computed with numpy are ints too), never a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_bool(name: str, value: object) -> bool:
    """A flag given as a bool (numpy's too), as a Python bool; anything else is refused, not read as truthy (a string
    such as "False" or "no", from a file or the environment, would turn the flag on)."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidInputError(f"{name}={value!r} is not a bool: {name} must be True or False")
    return bool(value)


def check_scale(scale: object, default: str) -> float | None:
    """An attention scale: None (`default` says what it then is) or a finite real number (numpy's too) as a Python
    float. The kernels turn NaN / inf into NaN outputs without a word, read a bool as 1.0 and fail deep in torch on a
    str, so every public entry point checks it."""
    if scale is not None and not is_finite_number(scale):
        raise InvalidInputError(f"scale={scale!r} must be a finite number or None ({default})")
    return None if scale is None else float(scale)


def is_finite_number(value: object) -> bool:
    """A finite real argument: a Python or numpy number, never a bool."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


class PrefixlabError(Exception):
    """Base class of every error prefixlab raises on purpose."""


class InvalidInputError(PrefixlabError, ValueError):
    """An argument is malformed (wrong type, shape, range, order, dtype or device)."""


class TraceFormatError(PrefixlabError, ValueError):
    """A trace file line cannot be parsed; the message names file:line."""


class ModelMismatchError(PrefixlabError, ValueError):
    """A store or cache built for one model is used with another (config or dtype differ; for a saved store, also
    its weights)."""


class UnsupportedModelError(PrefixlabError, TypeError):
    """A model or layer class prefixlab cannot serve; the message names the class."""


class CorruptStoreError(PrefixlabError, ValueError):
    """A saved store file is damaged (truncated, garbage, a checksum mismatch); the message names the file and the
    tensor or part that failed."""


class StoreClosedError(PrefixlabError, RuntimeError):
    """A PrefixStore (or a HybridPrefixCache over it) is used after `store.close()`."""


def check_not_compiled_wrapper(model: object, call: str) -> None:
    """InvalidInputError for the module `torch.compile(model)` returns: it passes attribute writes through to the
    model it wraps but not reads of what prefixlab sets on the model itself, so prefixlab takes the model, whose
    compiled wrapper then runs its hooks and patched layers."""
    if type(model).__name__ == "OptimizedModule" and "_orig_mod" in getattr(model, "_modules", {}):
        raise InvalidInputError(
            f"{call} was given the module torch.compile returned; give it the original model (compiled._orig_mod) "
            "and keep calling the compiled one: it runs the original's hooks and patched layers"
        )
