"""A model's weights version: what changes whenever a parameter is written, replaced or moved (a store compares it at
each request and drops entries computed under other weights)."""

from __future__ import annotations

import functools
import itertools
import json
import operator

import torch

from prefixlab.cache.devices import accelerate_hooks
from prefixlab.cache.walk import KeptWalk, at

_VERSION = operator.attrgetter("_version")
_DICT = operator.attrgetter("__dict__")
_SERIAL = "_prefixlab_serial"  # (the attribute holding a parameter's own number: _serials)
_next_serial = itertools.count(1)

# the optimizer step (a process-wide count) after which each parameter, by id, was last stepped: fused optimizers
# (torch's `fused=True` Adam / AdamW / SGD / Adagrad, HF Trainer's default) write weights without a version count
_STEPPED_AT: dict[int, int] = {}
_optimizer_steps = itertools.count(1)


def _note_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    step = next(_optimizer_steps)
    for group in optimizer.param_groups:
        _STEPPED_AT.update(dict.fromkeys(map(id, group["params"]), step))


@functools.cache
def watch_optimizer_steps() -> None:
    """Count every torch optimizer's steps from now on, once per process (a store's first build calls it)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_note_optimizer_step)


def weights_version(model: torch.nn.Module, kept: KeptWalk | None = None) -> tuple:
    """Changes whenever a parameter is written in place (an optimizer step, fused or not, load_state_dict), replaced,
    or given new storage (`param.data = ...`, moved to another device): each one's identity, version counter,
    storage address, last torch optimizer step (watch_optimizer_steps) and own number (_serials).
    Buffers, which models rewrite in place with the same values (longrope's inv_freq at every forward), parameters
    without a version counter (made under torch.inference_mode) and weights accelerate offloads to CPU memory
    (meta tensors in the model between forwards) count by a sample of their values, those it offloads to disk by
    their place in the offload files. Not seen: writes through `.data` (`param.data.copy_(...)`: autograd counts no
    version there) or by torch.distributed collectives (`broadcast` into parameters), in-place writes to part of a
    sampled tensor that miss its samples (one embedding row of an inference-mode model), and adapters switched
    without writing weights (PEFT's disable_adapter): call store.clear() after those. `kept`: the model's walk kept
    between calls."""
    walk, values = kept.of(model) if kept is not None else (None, None)
    if values is None:  # (no walk kept, accelerate's hooks)
        params, buffers, offloaded = _tensors(model)
    else:
        positions = walk.derived("tensors", lambda: [walk.positions(tensors) for tensors in _tensors(model)])
        params, buffers, offloaded = (at(values, where) for where in positions)
    try:  # (maps: a model's hundreds of parameters are read at each request)
        ids = tuple(map(id, params))
        versioned, sampled = (ids, tuple(map(_VERSION, params)), tuple(map(torch.Tensor.data_ptr, params)),
                              tuple(map(_STEPPED_AT.get, ids)), _serials(params)), list(buffers)
    except RuntimeError:  # an inference tensor, which has no version counter: count it by its values
        versioned, sampled = [], list(buffers)
        for param in params:
            try:
                versioned.append((id(param), param._version, param.data_ptr(), _STEPPED_AT.get(id(param)),
                                  _serials([param])))
            except RuntimeError:
                sampled.append(param)
    on_disk = tuple(value for value in offloaded if isinstance(value, tuple))
    # offloaded tensors' identities are not kept (a loader may build a new tensor at every access)
    offloaded = [value for value in offloaded if not isinstance(value, tuple)]
    return (tuple(versioned), tuple(id(tensor) for tensor in sampled), _value_samples(sampled + offloaded),
            on_disk)


def _serials(params: list[torch.Tensor]) -> tuple:
    """Each parameter's own number, given the first time it is read here: a parameter replaced by a new object has
    none of the old one's even where it reuses the old one's id, storage address and version count (CPython and the
    allocators hand freed memory to what is made next: `module.weight = None; module.weight = nn.Parameter(...)`;
    torch.utils.swap_tensors keeps the object and swaps its __dict__). Plain nn.Parameters only: accelerate rebuilds
    bitsandbytes' parameter classes with their __dict__ as constructor arguments."""
    found = tuple(map(dict.get, map(_DICT, params), itertools.repeat(_SERIAL)))
    if None in found:
        for param, serial in zip(params, found, strict=True):
            if serial is None and type(param) is torch.nn.Parameter:
                param.__dict__[_SERIAL] = next(_next_serial)
        found = tuple(map(dict.get, map(_DICT, params), itertools.repeat(_SERIAL)))
    return found


def rope_types(module: torch.nn.Module) -> list[tuple[str | None, str]]:
    """[(layer type or None, rope type)] of a rotary embedding module whose frequencies rescale with the length."""
    kinds = module.__dict__.get("rope_type")  # (a plain attribute of transformers' rotary embeddings)
    pairs = kinds.items() if isinstance(kinds, dict) else [(None, kinds)]
    return [(layer_type, kind) for layer_type, kind in pairs
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")]


def _value_samples(tensors: list[torch.Tensor], count: int = 64) -> tuple[bytes, ...]:
    """The bytes (bits: a NaN equals itself) of `count` elements spread over each of `tensors`, one copy to the host
    per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.device.type != "meta" and tensor.numel() and tensor.element_size():
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // count)][:count].contiguous().view(torch.uint8)
            by_device.setdefault(tensor.device, []).append(sample)
    return tuple(torch.cat(samples).cpu().numpy().tobytes() for samples in by_device.values())


def _tensors(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, buffers, offloaded weights) of `model`, each once, in a fixed order: `model.parameters()` without
    its nested generators, which cost each request (weights_version runs once per request) several times this walk's
    time. A meta tensor that an accelerate hook offloads counts as the value it loads for the forward; a rescaling
    RoPE's current frequencies do not count."""
    found, seen, stack = ([], [], []), set(), [model]
    while stack:
        module = stack.pop()
        offloaded = _offloaded_values(module) if "_hf_hook" in module.__dict__ else {}
        # a rescaling RoPE's frequencies follow each forward's length (rope_limit), not the weights
        rescaled = {f"{t or ''}{'_' if t else ''}inv_freq" for t, _ in rope_types(module)}
        for kind, tensors in enumerate((module._parameters.items(), module._buffers.items())):
            for name, tensor in tensors:
                if tensor is not None and id(tensor) not in seen and not (kind and name in rescaled):
                    seen.add(id(tensor))
                    if id(tensor) in offloaded:
                        found[2].append(offloaded[id(tensor)])
                    else:
                        found[kind].append(tensor)
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return found


def _offloaded_values(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The values accelerate's offloading hooks on `module` load for its forward (`AlignDevicesHook(offload=True)`,
    as `cpu_offload`, `disk_offload` and `device_map` with "cpu" / "disk" attach), by the id of the meta tensor that
    stands for each between forwards; those of its submodules too where one hook places them all."""
    values = {}
    for hook in accelerate_hooks(module):
        weights = getattr(hook, "weights_map", None)
        if not getattr(hook, "offload", False) or weights is None:
            continue
        recurse = bool(getattr(hook, "place_submodules", False))
        for name, tensor in (*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)):
            if tensor.device.type == "meta":
                try:
                    values[id(tensor)] = _offloaded_value(weights, name)
                except KeyError:  # a non-persistent buffer: not offloaded
                    continue
    return values


def _offloaded_value(weights, name: str) -> torch.Tensor | tuple:
    """The tensor an offloading hook loads for `name`, or for one read from disk its index entry (file, offset,
    dtype, shape): reading it at every request would cost a forward's reads, and a file changes only when rewritten."""
    loader, key = weights, name
    while hasattr(loader, "dataset") and hasattr(loader, "prefix"):  # accelerate's PrefixedDataset
        loader, key = loader.dataset, f"{loader.prefix}{key}"
    index, in_memory = getattr(loader, "index", None), getattr(loader, "state_dict", None)
    if isinstance(index, dict) and key in index and not (isinstance(in_memory, dict) and key in in_memory):
        return ("offloaded to disk", key, json.dumps(index[key], sort_keys=True, default=str))
    return weights[name]
