"""What the tensors of a store's entries must look like: the shapes, dtypes and devices the model's own layers
compute. `PrefixStore.admit` checks what a caller gives against them (an entry of other shapes, dtypes or devices
would be stored, then served: a crash inside a later request's forward, or other tokens than the model's); the
model's own admissions (a HybridPrefixCache's commits) set what is learned of them.

Two sources: the config (`expected_shapes`: the attention layers' kv_heads and head_dim, a recurrent layer's conv
shape and state size, where the config says one for all layers, as a HydragenCache checks a loaded prefix), and the
tensors the model computed through this store (every shape, less the token axis, and dtype, per layer and kind)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from prefixlab.cache.hfspec import spec_from_config
from prefixlab.cache.tensors import TensorKV, TensorState, check_kv, check_state, owning_kv
from prefixlab.errors import InvalidInputError, UnsupportedModelError

# per sequence, from a cost-model state group's dims: ((conv channels, conv kernel), recurrent state elements or
# None where the layer keeps no recurrent state); the state kinds the cost model reads (transformers 5.23's shapes)
_STATE_SHAPES = {
    "mamba2": lambda d: ((d["heads"] * d["head_dim"] + 2 * d["groups"] * d["state_size"], d["conv_kernel"]),
                         d["heads"] * d["head_dim"] * d["state_size"]),
    "mamba": lambda d: ((d["d_inner"], d["conv_kernel"]), d["d_inner"] * d["state_size"]),
    "gated_deltanet": lambda d: ((2 * d["k_heads"] * d["head_k_dim"] + d["v_heads"] * d["head_v_dim"],
                                  d["conv_kernel"]), d["v_heads"] * d["head_k_dim"] * d["head_v_dim"]),
    "short_conv": lambda d: ((d["hidden"], d["conv_kernel"]), None),
}


def expected_shapes(config) -> tuple[tuple[int, int] | None, tuple[tuple[int, int], int | None] | None]:
    """((kv_heads, head_dim) of the attention layers, ((conv channels, kernel), recurrent elements) of a recurrent
    layer's states per sequence), read from the config as the cost model reads it; None where the config does not
    say one shape for all (a model type it does not know, several kinds, a kind not in _STATE_SHAPES)."""
    try:  # (shapes do not depend on the dtype; a config the cost model cannot read leaves them unchecked)
        groups = spec_from_config(config, torch.float32).layers
    except (UnsupportedModelError, InvalidInputError):
        return None, None
    attention = {(d["kv_heads"], d["head_dim"]) for d in (dict(g.dims) for g in groups if g.kind == "attention")
                 if "kv_heads" in d}
    states = {_STATE_SHAPES[g.kind](dict(g.dims)) for g in groups if g.kind in _STATE_SHAPES}
    other_states = any(g.state_bytes and g.kind not in _STATE_SHAPES for g in groups)
    return (attention.pop() if len(attention) == 1 else None,
            states.pop() if len(states) == 1 and not other_states else None)


def _same_device(given: torch.device, wanted: torch.device) -> bool:
    """(a device without an index, "cuda", stands for the current one of its type)"""
    return given.type == wanted.type and None in (given.index, wanted.index) or given == wanted


class EntryShapes:
    """A store's expectations of its entries' tensors: `check_kv` / `check_state` refuse what the model would not
    have computed; `learn_*` records what it did compute."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.kv, states = expected_shapes(config)
        self.conv, self.held = states or (None, None)
        self.seen: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # (kind, key) -> (shape, dtype) computed

    def reader(self, kv: Callable[[int, int], object], states: dict[int, TensorState], layout,
               devices: dict[int, torch.device], device: torch.device,
               computed: bool) -> Callable[[int, int], TensorKV]:
        """Check (or learn, where the model `computed` them) `states` now, and return the `kv` callable of an
        admission checked (learned) as the core asks for it, each run in storage of its own (a view would keep a
        whole batch alive past the budget)."""
        for position, state in states.items():  # (before anything changes)
            check_state(state, layout, f"states[{position}]")
            if computed:
                self.learn_state(state)
            else:
                self.check_state(state, f"states[{position}]", devices, device)

        def checked(start: int, stop: int) -> TensorKV:
            run = check_kv(kv(start, stop), layout, self.dtype)
            if computed:
                self.learn_kv(run)
            else:
                self.check_kv(run, devices, device)
            return owning_kv(run)

        return checked

    def learn_kv(self, kv: TensorKV) -> None:
        for kind, side in zip(("keys", "values", "indexer"), kv.sides, strict=True):
            for layer, tensor in side.items():
                self.seen.setdefault((kind, layer), (_less_tokens(tensor), tensor.dtype))

    def learn_state(self, state: TensorState) -> None:
        for kind in ("conv", "recurrent"):
            for key, tensor in getattr(state, kind).items():
                self.seen.setdefault((kind, key), (tuple(tensor.shape), tensor.dtype))

    def check_kv(self, kv: TensorKV, devices: dict[int, torch.device], device: torch.device) -> None:
        """InvalidInputError unless each layer's K / V (and indexer keys) have the model's kv_heads and head_dim
        (as the config says, and as the model computed them here) on that layer's device."""
        for kind, side in zip(("keys", "values", "indexer"), kv.sides, strict=True):
            for layer, tensor in side.items():
                shape = _less_tokens(tensor)
                if kind != "indexer" and self.kv is not None and shape != self.kv:
                    self._refuse(f"{kind}[{layer}] have kv_heads={shape[0]}, head_dim={shape[1]}; this model's "
                                 f"attention layers have kv_heads={self.kv[0]}, head_dim={self.kv[1]}")
                self._check_seen((kind, layer), f"{kind}[{layer}]", shape, tensor.dtype)
                self._check_device(f"{kind}[{layer}]", tensor, devices.get(layer, device))

    def check_state(self, state: TensorState, name: str, devices: dict[int, torch.device],
                    device: torch.device) -> None:
        """InvalidInputError unless each conv / recurrent state has the model's per-sequence shape (no batch axis) and
        a floating dtype the model keeps states in, on its layer's device."""
        for kind in ("conv", "recurrent"):
            for key, tensor in getattr(state, kind).items():
                where, shape = f"{name}'s {kind} state {key}", tuple(tensor.shape)
                # a layer's first state is the one the config describes; others (Qwen4-Exp's n-gram context of
                # token ids, its PLE states) are known by what the model computed only
                first = key[1] == 0
                kept = sorted({str(self.dtype), str(torch.float32)})
                if first and (not tensor.is_floating_point() or ((kind, key) not in self.seen
                                                                 and tensor.dtype not in (self.dtype, torch.float32))):
                    self._refuse(f"{where} has dtype {tensor.dtype}; this model keeps its states in "
                                 f"{' or '.join(kept)}")
                wanted = self.conv if kind == "conv" else self.held
                if first and wanted is not None and (shape if kind == "conv" else math.prod(shape)) != wanted:
                    self._refuse(f"{where} has shape {list(shape)}; this model's layers take "
                                 + (f"{list(wanted)}" if kind == "conv" else f"{wanted} values"))
                self._check_seen((kind, key), where, shape, tensor.dtype)
                self._check_device(where, tensor, devices.get(key[0], device))

    def _check_seen(self, key: tuple, where: str, shape: tuple, dtype: torch.dtype) -> None:
        if key in self.seen and self.seen[key] != (shape, dtype):
            self._refuse(f"{where} has shape {list(shape)} and dtype {dtype}; the model computed "
                         f"{list(self.seen[key][0])} in {self.seen[key][1]} there")

    def _check_device(self, where: str, tensor: torch.Tensor, wanted: torch.device) -> None:
        if not _same_device(tensor.device, torch.device(wanted)):
            self._refuse(f"{where} is on {tensor.device}; this model computes that layer on {wanted}")

    @staticmethod
    def _refuse(what: str) -> None:
        raise InvalidInputError(f"store.admit: {what}; give the tensors this model computed for these tokens "
                                "(as a HybridPrefixCache request over them admits them)")


def _less_tokens(tensor: torch.Tensor) -> tuple[int, ...]:
    """A [heads, tokens, dim] tensor's shape without its token axis."""
    return (tensor.shape[0], tensor.shape[2])
