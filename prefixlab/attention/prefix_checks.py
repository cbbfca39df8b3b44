"""What `HydragenCache.load_shared_prefix` checks before it changes anything: every attention layer's keys/values
and every recurrent layer's states against the model's layers (shapes from the config, one dtype per kind, one
device), so that a bad prefix is refused with what to give instead of raising inside generate after the recurrent
layers have already run on it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from prefixlab.cache.entry_shapes import expected_shapes
from prefixlab.errors import InvalidInputError, is_int


def check_prefix(config, attention: list[int], recurrent: list[int], keeps_recurrent_state: bool, keys, values,
                 batch_size, conv_states, recurrent_states):
    """The (kv_heads, P, D) keys/values of each attention layer and the (batch_size, ...) conv / recurrent states
    (None: it keeps none) of each recurrent layer that `load_shared_prefix(...)` gives, once all are checked."""
    keys, values = dict(_indexed(keys, "keys")), dict(_indexed(values, "values"))
    if sorted(keys) != attention or sorted(values) != attention:
        raise InvalidInputError(f"keys/values must be given for exactly the attention layers {attention}")
    if not is_int(batch_size) or batch_size < 1:
        raise InvalidInputError(f"batch_size={batch_size!r} must be a positive int")
    shaped = {i: (_as_level(keys[i], f"keys[{i}]"), _as_level(values[i], f"values[{i}]")) for i in attention}
    lengths = {k.shape[1] for k, _ in shaped.values()}
    if len(lengths) != 1 or any(k.shape != v.shape for k, v in shaped.values()):
        raise InvalidInputError("every layer's prefix keys and values must have one shape and one length")
    if lengths == {0}:  # nothing to load (a store miss): no states, no shapes to check
        if conv_states or recurrent_states:  # (they would be dropped: the layers would start fresh, unlike asked)
            raise InvalidInputError("conv_states / recurrent_states were given with a 0-token prefix, which has no "
                                    "state after it: give them with the keys/values of the prefix they follow, or "
                                    "none (the recurrent layers then start from fresh states)")
        return shaped, {}
    kv_shape, state_shapes = expected_shapes(config)
    _check_kv(shaped, kv_shape)
    states = {"conv": conv_states or {}, "recurrent": recurrent_states or {}}
    wanted = {"conv": recurrent, "recurrent": recurrent if keeps_recurrent_state else []}
    if recurrent and any(sorted(states[kind]) != wanted[kind] for kind in states):
        given = " and recurrent_states" if keeps_recurrent_state else " (no recurrent_states: it keeps none)"
        raise InvalidInputError(
            f"this model has recurrent layers {recurrent}: give conv_states{given} for each, "
            "the state after the prefix (KV alone cannot resume them)"
        )
    conv = {i: _per_sequence(states["conv"][i], batch_size, f"conv_states[{i}]") for i in recurrent}
    held = {i: _per_sequence(states["recurrent"][i], batch_size, f"recurrent_states[{i}]")
            for i in wanted["recurrent"]}
    _check_states(conv, held, state_shapes)
    for i, tensors in [*shaped.items(), *((i, (conv[i], *([held[i]] if i in held else []))) for i in recurrent)]:
        if len({t.device for t in tensors}) > 1:  # (layers may be on several devices, each layer's tensors not)
            raise InvalidInputError(f"layer {i}'s prefix tensors are on several devices "
                                    f"({sorted(str(t.device) for t in tensors)}): give them on that layer's device")
    return shaped, {i: (conv[i], held.get(i)) for i in recurrent}


def _check_kv(shaped: dict, expected: tuple[int, int] | None) -> None:
    _one_dtype("keys/values", [t for pair in shaped.values() for t in pair])
    for i, (k, _) in shaped.items():
        heads, _, dim = k.shape
        if (heads, dim) != (expected or (heads, dim)):
            raise InvalidInputError(
                f"keys[{i}]/values[{i}] have kv_heads={heads}, head_dim={dim}; this model's attention layers have "
                f"kv_heads={expected[0]}, head_dim={expected[1]}: give the KV this model computed for the prefix"
            )
    if expected is None and len({(k.shape[0], k.shape[2]) for k, _ in shaped.values()}) > 1:
        raise InvalidInputError("the attention layers' keys/values differ in kv_heads or head_dim: give every layer "
                                "the (kv_heads, P, head_dim) KV this model computed for the prefix")


def _check_states(conv: dict, held: dict, expected) -> None:
    """One per-sequence shape and one dtype for each kind of state, and the config's shape where it says one."""
    conv_shape, held_elements = expected or (None, None)
    kinds = (("conv_states", conv, lambda shape: conv_shape in (None, shape),
              f"(batch, {conv_shape[0]} channels, kernel {conv_shape[1]})" if conv_shape else None),
             ("recurrent_states", held, lambda shape: held_elements in (None, math.prod(shape)),
              f"{held_elements} values per sequence" if held_elements else None))
    for name, states, fits, want in kinds:
        _one_dtype(name, list(states.values()))
        shapes = {i: tuple(t.shape[1:]) for i, t in states.items()}
        common = max(shapes.values(), key=list(shapes.values()).count, default=None)  # (most layers' shape)
        for i, shape in shapes.items():
            if not fits(shape) or shape != common:
                raise InvalidInputError(
                    f"{name}[{i}] has the per-sequence shape {shape}; this model's layers take "
                    f"{want or f'one shape, {common} in the other layers'} (layers: {shapes}): give the states this "
                    "model computed for the prefix"
                )


def _one_dtype(name: str, tensors: list[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1 or any(not dtype.is_floating_point for dtype in dtypes):
        raise InvalidInputError(f"{name} have dtype {sorted(map(str, dtypes))}: give them all in one floating dtype, "
                                "the one the model computed them in")


def _indexed(per_layer, name: str):
    if isinstance(per_layer, Mapping):
        return per_layer.items()
    if isinstance(per_layer, Sequence):
        return ((i, t) for i, t in enumerate(per_layer) if t is not None)
    raise InvalidInputError(
        f"{name} must be a mapping or sequence of per-layer tensors, got {type(per_layer).__name__}"
    )


def _as_level(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.ndim not in (3, 4) or (tensor.ndim == 4 and tensor.shape[0] != 1):
        shape = getattr(tensor, "shape", type(tensor).__name__)
        raise InvalidInputError(f"{name} must be (1, kv_heads, P, D) or (kv_heads, P, D), got {shape}")
    return (tensor[0] if tensor.ndim == 4 else tensor).contiguous()


def _per_sequence(state: torch.Tensor, batch_size: int, name: str) -> torch.Tensor:
    if not isinstance(state, torch.Tensor) or state.ndim < 2 or state.shape[0] not in (1, batch_size):
        raise InvalidInputError(f"{name} must have batch 1 or {batch_size}, got {getattr(state, 'shape', state)}")
    return state.expand(batch_size, *state.shape[1:]).clone()
