"""Validation of what callers pass as token ids and namespaces (shared by the core, the store and the router)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from prefixlab.errors import InvalidInputError


def as_tokens(tokens: object, name: str = "tokens") -> np.ndarray:
    """`tokens` as a 1-D int64 array of non-negative ids, or InvalidInputError naming `name`."""
    try:
        array = np.asarray(tokens)
    except (ValueError, OverflowError) as err:
        raise InvalidInputError(f"{name} must be a flat sequence of int token ids ({err})") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError(
            f"{name} must be a flat sequence of int token ids, got a {array.ndim}-D array of dtype {array.dtype}; "
            "pass a list or 1-D integer numpy array"
        )
    if array.size and array.min() < 0:
        raise InvalidInputError(f"{name} has a negative token id ({array.min()}); token ids are >= 0")
    if array.size and array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max:  # (astype would wrap it)
        raise InvalidInputError(f"{name} has a token id of 2**63 or more ({array.max()}); token ids fit in int64")
    return array.astype(np.int64, copy=False)


def as_states(states: object) -> dict:
    """`states` ({position: state payload}, or None for none) as a new dict, or InvalidInputError."""
    if states is not None and not isinstance(states, Mapping):
        raise InvalidInputError(f"states must be a dict {{position: state}} (or None), got {type(states).__name__}")
    return dict(states or {})


def check_namespace(namespace: object) -> str:
    """`namespace` if it is a non-empty str, else InvalidInputError."""
    if not isinstance(namespace, str) or not namespace:
        raise InvalidInputError(f"namespace must be a non-empty str, got {namespace!r}")
    return namespace
