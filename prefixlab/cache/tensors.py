"""Tensor payloads for real models: what the radix tree holds when it serves a Hugging Face model.

`TensorKV` is the attention KV of a run of tokens for one sequence (every attention layer's K and V, no batch axis;
a sparse-attention (DSA) indexer's keys too); it follows the `KVPayload` protocol, so the tree can split an edge or
join two. `TensorState` is one checkpoint: every recurrent layer's conv and recurrent state after a given position
(no batch axis). Both are immutable by convention: nothing in prefixlab writes into their tensors, and requests resume
from copies (see `cache/hf.py`).

Byte sizes are exact (`numel * element_size`), and `split` / `concat` allocate fresh storage, so evicting a payload
frees exactly the bytes it reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from prefixlab.errors import InvalidInputError

# Token axis of a per-sequence KV tensor [kv_heads, tokens, head_dim].
TOKEN_AXIS = -2


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _move(tensor: torch.Tensor, device: torch.device | str, pin: bool) -> torch.Tensor:
    moved = tensor.to(device, copy=True)
    return moved.pin_memory() if pin else moved


@dataclass(frozen=True, eq=False)
class TensorKV:
    """K and V of `ntokens` tokens for each attention layer: `keys[layer]` is [kv_heads, ntokens, head_dim].
    `indexer[layer]` is [1, ntokens, width]: the per-token keys a DSA indexer caches beside K and V (GLM-5-Next's
    `DynamicIndexedLayer.indexer_keys`), for those attention layers that run one.

    A model without attention layers still has token runs (the tree needs their length), with empty mappings.
    """

    ntokens: int
    keys: Mapping[int, torch.Tensor]
    values: Mapping[int, torch.Tensor]
    indexer: Mapping[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keys.keys() != self.values.keys() or not self.indexer.keys() <= self.keys.keys():
            raise InvalidInputError(f"TensorKV keys layers {sorted(self.keys)} != values layers {sorted(self.values)} "
                                    f"(indexer layers {sorted(self.indexer)} must be among them)")
        for layer, tensor in (*self.keys.items(), *self.values.items(), *self.indexer.items()):
            if tensor.dim() != 3 or tensor.shape[TOKEN_AXIS] != self.ntokens:
                raise InvalidInputError(
                    f"TensorKV layer {layer} has shape {list(tensor.shape)}; expected [kv_heads, {self.ntokens}, "
                    "head_dim] (one sequence, no batch axis)"
                )

    @property
    def sides(self) -> tuple[Mapping[int, torch.Tensor], ...]:
        """(keys, values, indexer): every per-token tensor mapping, in the order the constructor takes them."""
        return self.keys, self.values, self.indexer

    def mapped(self, ntokens: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> TensorKV:
        """A TensorKV of `ntokens` tokens holding fn(tensor) for each of this one's tensors."""
        return TensorKV(ntokens, *({layer: fn(t) for layer, t in side.items()} for side in self.sides))

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(side.values()) for side in self.sides)

    def split(self, at: int) -> tuple[TensorKV, TensorKV]:
        """The first `at` tokens and the rest, each in its own storage."""
        if not 0 <= at <= self.ntokens:
            raise InvalidInputError(f"split at={at} is outside [0, {self.ntokens}]")
        return (self.mapped(at, lambda t: t[:, :at].clone()),
                self.mapped(self.ntokens - at, lambda t: t[:, at:].clone()))

    def concat(self, other: TensorKV) -> TensorKV:
        """This run followed by `other` (same layers, same device)."""
        if not isinstance(other, TensorKV) or other.keys.keys() != self.keys.keys() \
                or other.indexer.keys() != self.indexer.keys():
            raise InvalidInputError("concat needs a TensorKV over the same attention layers")
        return TensorKV(self.ntokens + other.ntokens, *(
            {layer: torch.cat([a[layer], b[layer]], dim=TOKEN_AXIS) for layer in a}
            for a, b in zip(self.sides, other.sides, strict=True)))

    def to(self, device: torch.device | str, pin: bool = False) -> TensorKV:
        """A copy on `device` (pinned host memory when `pin`)."""
        return self.mapped(self.ntokens, lambda t: _move(t, device, pin))

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.keys.values())).device if self.keys else None


@dataclass(frozen=True, eq=False)
class TensorState:
    """A recurrent checkpoint: `conv[(layer, i)]` / `recurrent[(layer, i)]` are state `i` of a recurrent layer
    (most layers have one; a few families keep several per layer), without the batch axis."""

    conv: Mapping[tuple[int, int], torch.Tensor]
    recurrent: Mapping[tuple[int, int], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.conv.values()) + _tensor_bytes(self.recurrent.values())

    def to(self, device: torch.device | str, pin: bool = False) -> TensorState:
        """A copy on `device` (pinned host memory when `pin`)."""
        return TensorState(
            {key: _move(t, device, pin) for key, t in self.conv.items()},
            {key: _move(t, device, pin) for key, t in self.recurrent.items()},
        )

    @property
    def device(self) -> torch.device | None:
        tensors = [*self.conv.values(), *self.recurrent.values()]
        return tensors[0].device if tensors else None


def path_kv(pieces: list[TensorKV], device: torch.device | str | None = None,
            pin: bool = False) -> Callable[[int, int], TensorKV]:
    """kv(a, b): tokens [a, b) of the run formed by consecutive KV `pieces` (a root-to-node path of the tree), in
    storage of its own (on `device`, pinned when `pin`, if given). Only the pieces that overlap [a, b) are read, and
    moved before they are joined: an eviction to the host copies the bytes the host tier asks for, not the path."""

    def kv(start: int, stop: int) -> TensorKV:
        if not 0 <= start <= stop:
            raise InvalidInputError(f"kv({start}, {stop}) is not a token range")
        sides: list[dict[int, list[torch.Tensor]]] = [{layer: [] for layer in side} for side in pieces[0].sides]
        first = 0
        for piece in pieces:
            low, high = max(start, first), min(stop, first + piece.ntokens)
            if low < high:
                for parts, tensors in zip(sides, piece.sides, strict=True):
                    for layer, tensor in tensors.items():
                        part = tensor[:, low - first : high - first]
                        parts[layer].append(part if device is None else _move(part, device, pin))
            first += piece.ntokens
        if stop > first:
            raise InvalidInputError(f"kv({start}, {stop}) reaches past the path's {first} tokens")
        if start == stop:  # no tokens, of the path's layers and shapes (nothing read)
            return pieces[0].mapped(0, lambda t: t.new_empty((*t.shape[:TOKEN_AXIS], 0, t.shape[-1]),
                                                             device=device or t.device))
        return TensorKV(stop - start, *({layer: _joined(p) for layer, p in parts.items()} for parts in sides))

    return kv


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts joined along the token axis, in fresh storage (a lone part that views a larger one is copied)."""
    return torch.cat(parts, dim=TOKEN_AXIS) if len(parts) > 1 else owning(parts[0])


def owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy when it views a larger storage (a slice of a batch, of a stack of states one kernel call
    emitted): stored as it is, it would keep all of that storage alive past the byte budget."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() else tensor.clone()


def owning_state(state: TensorState) -> TensorState:
    """`state` with every tensor in storage of its own (`owning`)."""
    return TensorState({key: owning(t) for key, t in state.conv.items()},
                       {key: owning(t) for key, t in state.recurrent.items()})


def owning_kv(kv: TensorKV) -> TensorKV:
    """`kv` with every tensor in storage of its own (`owning`)."""
    return kv.mapped(kv.ntokens, owning)


def spill_evictions(eviction, host) -> None:
    """Wrap a device tier's `eviction.free` and `eviction.drop_state`: before a victim is freed, its path (tokens up
    to the victim's end, the KV the `host` tier lacks of them, the victim's checkpoints; up to the state for a
    dropped state) goes to the host tier (a PrefixCacheCore), which admits or drops it under its own budget."""
    free_on_device, drop_on_device, pin = eviction.free, eviction.drop_state, torch.cuda.is_available()

    def spill(node, positions: list[int], states: list) -> None:
        path = []
        while not node.is_root:
            path.append(node)
            node = node.parent
        path.reverse()
        tokens = [t for n in path for t in n.tokens.tolist()][: max(positions, default=path[-1].end)]
        host.admit(tokens, kv=path_kv([n.kv for n in path], "cpu", pin),
                   states={p: s.to("cpu", pin) for p, s in zip(positions, states, strict=True)},
                   namespace=path[-1].namespace, restore=True)

    def free(node, want_bytes: int) -> int:
        spill(node, node.ckpt_pos, node.ckpt_state)
        return free_on_device(node, want_bytes)

    def drop_state(node, index: int) -> int:
        spill(node, node.ckpt_pos[index : index + 1], node.ckpt_state[index : index + 1])
        return drop_on_device(node, index)

    eviction.free, eviction.drop_state = free, drop_state


# Flat names for safetensors files: one string key per tensor.
def kv_to_flat(kv: TensorKV, prefix: str) -> dict[str, torch.Tensor]:
    flat = {f"{prefix}.k.{layer}": t.contiguous() for layer, t in kv.keys.items()}
    flat.update({f"{prefix}.v.{layer}": t.contiguous() for layer, t in kv.values.items()})
    flat.update({f"{prefix}.i.{layer}": t.contiguous() for layer, t in kv.indexer.items()})
    return flat


def kv_from_flat(flat: Mapping[str, torch.Tensor], prefix: str, ntokens: int) -> TensorKV:
    sides: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "i": {}}
    for name, tensor in flat.items():
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[0] == prefix and parts[1] in sides:
            sides[parts[1]][int(parts[2])] = tensor
    return TensorKV(ntokens, sides["k"], sides["v"], sides["i"])


def state_to_flat(state: TensorState, prefix: str) -> dict[str, torch.Tensor]:
    flat = {f"{prefix}.conv.{layer}.{i}": t.contiguous() for (layer, i), t in state.conv.items()}
    flat.update({f"{prefix}.recurrent.{layer}.{i}": t.contiguous() for (layer, i), t in state.recurrent.items()})
    return flat


def state_from_flat(flat: Mapping[str, torch.Tensor], prefix: str) -> TensorState:
    conv, recurrent = {}, {}
    for name, tensor in flat.items():
        parts = name.rsplit(".", 3)
        if len(parts) == 4 and parts[0] == prefix and parts[1] in ("conv", "recurrent"):
            (conv if parts[1] == "conv" else recurrent)[(int(parts[2]), int(parts[3]))] = tensor
    return TensorState(conv, recurrent)


def snapshot_states(layers: list, state_layers: tuple[int, ...]) -> dict[str, dict[tuple[int, int], torch.Tensor]]:
    """Clones of the states the cache `layers` hold now (all rows): {"conv" | "recurrent": {(layer, state): tensor}};
    detached, as everything the store keeps (a forward with grad enabled must not leave its graph in the store)."""
    conv, recurrent = {}, {}
    for layer_idx in state_layers:
        layer = layers[layer_idx]
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                conv[(layer_idx, i)] = layer.conv_states[i].detach().clone()
            if layer.is_recurrent_states_initialized[i]:
                recurrent[(layer_idx, i)] = layer.recurrent_states[i].detach().clone()
    return {"conv": conv, "recurrent": recurrent}


def row_states(snapshots: dict[int, dict], row_captured: dict[tuple[int, int], dict], row: int, pad: int,
               stop: int) -> dict[int, TensorState]:
    """Batch row `row`'s states by real position, for its admission up to `stop`: those of the batch's `snapshots`
    (column: snapshot_states' dict) past its `pad` columns, and (right padding) those it captured alone
    (`row_captured`, (row, column): [1, ...] tensors; its end's among them)."""
    states = {pos - pad: TensorState({k: _row_of(t, row) for k, t in snap["conv"].items()},
                                     {k: _row_of(t, row) for k, t in snap["recurrent"].items()})
              for pos, snap in snapshots.items() if pad < pos <= stop}
    return states | {pos: TensorState({k: t[0] for k, t in snap["conv"].items()},
                                      {k: t[0] for k, t in snap["recurrent"].items()})
                     for (of, pos), snap in row_captured.items() if of == row and pos <= stop}


def _row_of(snapshot: torch.Tensor, row: int) -> torch.Tensor:
    """A batch row of a state snapshot (owned: never written again) for the store: the snapshot itself for a batch
    of one, else a copy (a view would keep the whole batch's tensor alive)."""
    return snapshot[row] if snapshot.shape[0] == 1 else snapshot[row].clone()


def row_kv(layers: list, layout, row: int, pad: int) -> Callable[[int, int], TensorKV]:
    """kv(a, b): batch row `row`'s KV in the cache `layers` (of a CacheLayout `layout`) for its real tokens [a, b)
    (after its `pad` columns)."""

    def kv(start: int, stop: int) -> TensorKV:
        cut = slice(start + pad, stop + pad)
        return TensorKV(stop - start, {i: layers[i].keys[row, :, cut].detach().clone() for i in layout.kv_layers},
                        {i: layers[i].values[row, :, cut].detach().clone() for i in layout.kv_layers},
                        {i: layers[i].indexer_keys[row, None, cut].detach().clone() for i in layout.indexer_layers})

    return kv


def check_kv(kv: object, layout, dtype: torch.dtype) -> TensorKV:
    """`kv` if it is a TensorKV of exactly the attention layers of `layout` (a CacheLayout; indexer keys for its
    `indexer_layers`) in `dtype`, else InvalidInputError: an entry of other layers or dtype would fail (or mislead)
    every later request that loads it."""
    if not isinstance(kv, TensorKV):
        raise InvalidInputError(f"kv(start, end) must return a TensorKV, got {type(kv).__name__}")
    if sorted(kv.keys) != sorted(layout.kv_layers):
        raise InvalidInputError(f"the KV must hold exactly the attention layers {list(layout.kv_layers)}, got "
                                f"{sorted(kv.keys)}")
    if sorted(kv.indexer) != sorted(layout.indexer_layers):
        raise InvalidInputError(f"the KV must hold indexer keys for exactly the layers {list(layout.indexer_layers)}"
                                f", got {sorted(kv.indexer)}")
    if any(t.dtype != dtype for side in kv.sides for t in side.values()):
        raise InvalidInputError(f"the KV must be in the store's dtype {dtype} (the model's)")
    return kv


def check_state(state: object, layout, name: str = "state") -> None:
    """InvalidInputError unless `state` is a TensorState with a conv state for each recurrent layer of `layout` (a
    CacheLayout) and a recurrent state for each of its `recurrent_layers`, no other (an empty one would let a request
    resume from nothing, a missing one from zeros)."""
    if not isinstance(state, TensorState):
        raise InvalidInputError(f"{name} must be a TensorState, got {type(state).__name__}")
    conv, recurrent = (sorted({layer for layer, _ in part}) for part in (state.conv, state.recurrent))
    conv_layers = layout.state_layers if layout.conv_layers is None else layout.conv_layers
    if conv != sorted(conv_layers) or recurrent != sorted(layout.recurrent_layers):
        raise InvalidInputError(f"{name} must hold a conv state for each recurrent layer {list(conv_layers)} "
                                f"and a recurrent state for {list(layout.recurrent_layers)}; got conv {conv}, "
                                f"recurrent {recurrent}")


def check_held_states(states: dict[int, TensorState], layout) -> None:
    """check_state for the states a HybridPrefixCache holds, naming the cause where layers hold none: a module
    that keeps no state in the cache runs there (one put in place of a linear-attention layer), so that the
    error does not read as a bad argument of an API call the caller never made."""
    for state in states.values():
        try:
            check_state(state, layout)
        except InvalidInputError:
            conv_layers = layout.state_layers if layout.conv_layers is None else layout.conv_layers
            missing = sorted({*conv_layers} - {layer for layer, _ in state.conv}
                             | {*layout.recurrent_layers} - {layer for layer, _ in state.recurrent})
            if not missing:
                raise
            raise InvalidInputError(
                f"the model's recurrent layer(s) {missing} kept no state in the cache over this request: the module "
                "running there (one put in place of a linear-attention layer?) does not write its states to the cache "
                "as transformers' layers do, so no prefix through it can be stored; put back a layer prefixlab "
                "supports, or generate without a PrefixStore") from None
