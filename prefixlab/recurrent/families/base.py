"""What every patched linear-attention layer shares: the cache protocol, the conv with state, the layer's flow.

A family (families/*.py) only says how its layer projects the input, mixes the conv output through its scan and
gates the result; `run_layer` does the rest the same way for all of them:

    mask padding -> project -> conv from the cached conv state -> scan from the cached recurrent state
    -> record the states at the capture offsets -> write the final states as transformers does -> gate + project

Capture protocol (docs/ARCHITECTURE.md): if the transformers Cache has `prefixlab_capture_positions`, it is either
  * a sequence of ints: offsets in [0, T] of this forward's T tokens, shared by every row; each offset o gives one
    `cache.prefixlab_record(layer_idx, o, conv_state, recurrent_state)` with the whole batch [B, ...]; or
  * a sequence of B sequences of ints: offsets per batch row; each (row b, offset o) gives one
    `cache.prefixlab_record(layer_idx, o, conv_state, recurrent_state, row=b)` with a batch of one [1, ...].
A layer that keeps several states (Inkling's short convs, one cache slot each) adds `state_idx=i` for its state i > 0.
Offsets count positions of this forward's (left-padded) input, so offset o is the state after its first o tokens;
each list is sorted and distinct. Recorded tensors are fresh clones in the layout and dtype the cache layer stores
(conv state [B, C, K]: the last K conv inputs, zeros before the first token; recurrent_state None for conv-only
layers, conv_state None for layers without a conv: MiniMax's lightning attention).
A cache with `prefixlab_decode_differs(flag)` is handed, by each decode step of a layer whose decode and prefill
forms may differ (Nemotron-H, Zamba2), a bool tensor saying whether they did for this token (no device sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from prefixlab.errors import InvalidInputError, is_int
from prefixlab.recurrent._checks import check_tensor
from prefixlab.recurrent.conv import conv_with_history

States = dict[int, torch.Tensor]
ORIGINAL_ATTRIBUTE = "_prefixlab_original_forward"  # on a patched layer: (attribute swapped, its value before or None)
CAPTURE_ATTRIBUTE = "prefixlab_capture_positions"
DECODE_ATTRIBUTE = "prefixlab_decode_differs"  # cache.prefixlab_decode_differs(flag): see Mixed.decode_differs


@dataclass
class Projected:
    """A family's projections of the layer input: the conv input [B, C, T] and whatever else it gates with."""

    conv_input: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Mixed:
    """A family's scan result: per-token outputs, the final recurrent state, and states at the capture offsets."""

    output: torch.Tensor
    final_state: torch.Tensor | None
    states: States
    # a bool tensor when this decode step may compute what a prefill would not: whether it did (families/mamba2.py)
    decode_differs: torch.Tensor | None = None


@dataclass(frozen=True)
class ScanRequest:
    """What the scan needs besides the layer's own tensors."""

    initial_state: torch.Tensor | None
    capture: tuple[int, ...]
    mask: torch.Tensor | None
    backend: str


class Family(Protocol):
    """One layer family: the layer classes it serves and its family-specific steps (all pure, no cache access).
    A family whose layer does not fit these steps (families/cca.py, inline_conv.py) has a `run(layer, *args,
    **kwargs)` instead, called with the layer's own arguments in place of its forward."""

    classes: tuple[str, ...]
    has_recurrent_state: bool
    conv_name: str  # the layer's depthwise nn.Conv1d
    read_directly: tuple[str, ...]  # children whose weights are read without calling them (accelerate hooks)

    def activation(self, layer: nn.Module) -> str | None: ...

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected: ...

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed: ...

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor: ...


def mask_padding(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions ([B, T, D] * [B, T]), as transformers' apply_mask_to_padding_states."""
    if mask is None:
        return hidden_states
    return (hidden_states * mask[:, :, None]).to(hidden_states.dtype)


def padding_mask(attention_mask: Any, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The 2D padding mask of the layer input's tokens, from the one the model hands the layer. Mamba and
    Falcon-Mamba hand their input mask as given, which spans the cached tokens too when a forward continues a
    cache (prefixlab's hooks pass such forwards): its last columns are this forward's, as transformers'
    create_recurrent_attention_mask trims it for the other models."""
    if attention_mask is None:
        return None
    batch, length = hidden_states.shape[:2]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[1] > length:
        attention_mask = attention_mask[:, -length:]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (batch, length):
        shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise InvalidInputError(
            f"attention_mask for a linear-attention layer must be a [batch, seq_len] = [{batch}, {length}] padding "
            f"mask (what the model builds with create_recurrent_attention_mask), got {shape}"
        )
    return attention_mask


class LayerCache:
    """One layer's view of the transformers Cache for one forward: cached states in, capture offsets, records out."""

    def __init__(self, cache: Any, layer_idx: int, batch: int, length: int, has_recurrent_state: bool,
                 state_idx: int = 0, has_conv_state: bool = True):
        self.cache, self.layer_idx, self.state_idx = cache, layer_idx, state_idx
        self.conv_state = self.recurrent_state = None
        if cache is not None and has_conv_state:
            self.conv_state = cache.get_conv_state(layer_idx, state_idx)
        if cache is not None and has_recurrent_state:
            self.recurrent_state = cache.get_recurrent_state(layer_idx, state_idx)
        self.rows = capture_rows(getattr(cache, CAPTURE_ATTRIBUTE, None), batch, length)
        self.positions = tuple(sorted(set().union(*self.rows.values()))) if self.rows else ()

    def record(self, conv_states: States, recurrent_states: States, recurrent_dtype: torch.dtype | None) -> None:
        """Hand the cache the states at each requested offset (before any cache write, which may overwrite
        buffers the offset-0 state was read from)."""
        for row, offsets in self.rows.items():
            extra = ({} if row is None else {"row": row}) | ({"state_idx": self.state_idx} if self.state_idx else {})
            for offset in offsets:
                state, conv = recurrent_states.get(offset), conv_states.get(offset)
                self.cache.prefixlab_record(
                    self.layer_idx,
                    offset,
                    None if conv is None else owned(conv, row),
                    None if state is None else owned(state, row).to(recurrent_dtype),
                    **extra,
                )

    def recurrent_dtype(self, final_state: torch.Tensor | None) -> torch.dtype | None:
        """The dtype the cache layer keeps recurrent states in (the first state written fixes it)."""
        if final_state is None:
            return None
        stored = self.cache.layers[self.layer_idx].recurrent_states[0] if self.cache is not None else None
        return final_state.dtype if stored is None else stored.dtype

    def write(self, conv_input: torch.Tensor, conv_kernel_size: int, final_state: torch.Tensor | None) -> None:
        """Store the final states exactly as transformers' layers do (update_conv_state keeps the last K conv
        inputs, or the whole history while the cache records the past; update_recurrent_state copies in place)."""
        if self.cache is None:
            return
        self.cache.update_conv_state(conv_input, self.layer_idx, conv_kernel_size=conv_kernel_size)
        if final_state is not None:
            self.cache.update_recurrent_state(final_state, self.layer_idx)


def original_forward(layer: nn.Module) -> Any:
    """The layer's own (transformers') forward, which prefixlab.recurrent.patch swapped out."""
    attribute, original = vars(layer)[ORIGINAL_ATTRIBUTE]
    return original if original is not None else getattr(type(layer), attribute).__get__(layer)


def owned(tensor: torch.Tensor, row: int | None) -> torch.Tensor:
    """A tensor the caller owns: the kernel's fresh state itself, or a copy of one row of it (never a view that
    would keep the whole batch alive)."""
    return tensor if row is None else tensor[row : row + 1].clone()


def capture_rows(positions: Any, batch: int, length: int) -> dict[int | None, tuple[int, ...]]:
    """{None: offsets} for shared offsets, {row: offsets} for per-row ones; {} when nothing is captured."""
    if positions is None:
        return {}
    if not isinstance(positions, Sequence) or isinstance(positions, str):
        raise InvalidInputError(
            f"{CAPTURE_ATTRIBUTE} must be a list of ints or a list of {batch} lists of ints (one per batch row), "
            f"got {type(positions).__name__}"
        )
    if all(_is_int(p) for p in positions):
        return {None: _offsets(positions, length, CAPTURE_ATTRIBUTE)}
    if len(positions) != batch or not all(isinstance(r, Sequence) and not isinstance(r, str) for r in positions):
        raise InvalidInputError(
            f"{CAPTURE_ATTRIBUTE} must be a list of ints or a list of {batch} lists of ints (one per batch row), "
            f"got {positions!r}"
        )
    rows = {b: _offsets(r, length, f"{CAPTURE_ATTRIBUTE}[{b}]") for b, r in enumerate(positions)}
    return {b: offsets for b, offsets in rows.items() if offsets}


def _is_int(value: Any) -> bool:
    """A Python or numpy integer, never a bool (offsets computed with numpy are ints, as the kernels take them)."""
    return type(value) is int or is_int(value)


def _offsets(values: Sequence[Any], length: int, name: str) -> tuple[int, ...]:
    offsets = tuple(values)
    if not all(_is_int(o) and 0 <= o <= length for o in offsets):
        raise InvalidInputError(
            f"{name} must hold ints in [0, {length}] for a forward over {length} tokens, got {list(offsets)}"
        )
    offsets = tuple(int(o) for o in offsets)  # (recorded as Python ints: a cache keys its states by them)
    if any(a >= b for a, b in zip(offsets, offsets[1:], strict=False)):
        raise InvalidInputError(f"{name} must be sorted and distinct, got {list(offsets)}")
    return offsets


def run_layer(
    layer: nn.Module,
    family: Family,
    hidden_states: torch.Tensor,
    cache: Any,
    attention_mask: Any,
    backend: str,
) -> torch.Tensor:
    """The patched forward of one linear-attention layer (see the module docstring). The layer comes first, as
    transformers' force_accelerate_hooks expects of a forward."""
    if torch.is_autocast_enabled(hidden_states.device.type):  # (the kernels keep their inputs' dtypes)
        raise InvalidInputError(
            f"{type(layer).__name__} is patched by prefixlab, whose kernels do not run under torch.autocast: convert "
            "the model instead (model.to(torch.bfloat16)), or prefixlab.unpatch(model) to run it under "
            "autocast without a PrefixStore")
    mask = padding_mask(attention_mask, hidden_states)
    batch, length = hidden_states.shape[:2]
    view = LayerCache(cache, layer.layer_idx, batch, length, family.has_recurrent_state)
    projected = family.project(layer, mask_padding(hidden_states, mask))
    conv = getattr(layer, family.conv_name)
    kernel_size = conv.kernel_size[0]
    # While transformers records the past, the cached conv state is the whole history: the conv needs its last K.
    history = None if view.conv_state is None else view.conv_state[..., -kernel_size:]
    if history is not None and history.shape[-1] < kernel_size:  # a recorded past shorter than K: zeros before it
        history = torch.nn.functional.pad(history, (kernel_size - history.shape[-1], 0))
    if history is not None:  # the rest comes from the layer itself; the cache's state may not fit this batch
        check_tensor("initial_conv_state", history, (batch, projected.conv_input.shape[1], kernel_size))
    conv_output, _, conv_states = conv_with_history(
        projected.conv_input, conv.weight[:, 0], conv.bias, family.activation(layer), history, view.positions
    )
    request = ScanRequest(view.recurrent_state, view.positions, mask, _scan_backend(backend, hidden_states))
    mixed = family.mix(layer, conv_output.transpose(1, 2), projected, request)
    view.record(conv_states, mixed.states, view.recurrent_dtype(mixed.final_state))
    if mixed.decode_differs is not None and hasattr(cache, DECODE_ATTRIBUTE):
        getattr(cache, DECODE_ATTRIBUTE)(mixed.decode_differs)
    view.write(projected.conv_input, kernel_size, mixed.final_state)
    return family.finish(layer, mixed.output, projected)


def _scan_backend(backend: str, hidden_states: torch.Tensor) -> str:
    """For one token (decode) the token loop is a single recurrence step, where a chunked kernel would pad it to a
    whole chunk (measured on CPU: 100x slower for SSD, 8x for the delta rule). "auto" is left to the kernel, which
    keeps fla / mamba_ssm where they take the inputs and otherwise runs that loop too (resolve_backend)."""
    return "naive" if hidden_states.shape[1] == 1 and backend != "auto" else backend
