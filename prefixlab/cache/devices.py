"""Where a model's layers compute, so resumed KV and states go where each layer reads them: one device for a model
in one place, one per layer for a model accelerate dispatches (`device_map` over several GPUs, CPU or disk offload,
`cpu_offload`), whose offloaded parameters are meta tensors between forwards."""

from __future__ import annotations

import torch

from prefixlab.cache.walk import KeptWalk, ModuleWalk, at
from prefixlab.errors import is_int


def execution_device(model: torch.nn.Module) -> torch.device:
    """The device `model` computes on: `model.device`, unless its first parameter is an offloaded meta tensor; then
    the device accelerate's hooks load its weights to."""
    device = model.device
    if device.type != "meta":
        return device
    found = (_hook_device(module) for module in model.modules())
    return next((device for device in found if device is not None), device)


def layer_devices(model: torch.nn.Module, kept: KeptWalk | None = None) -> dict[int, torch.device]:
    """{layer_idx: the device that layer computes on} for the modules that carry a `layer_idx` (transformers'
    attention and linear-attention modules), the first such module of an index deciding: a hook on the module or
    one of its submodules (each hooked where it has parameters: `cpu_offload`), else its nearest hooked ancestor's
    (one hook places a whole block: `device_map`), else its parameters' device. `kept`: the model's walk kept
    between calls (cache/walk.py)."""
    walk, values = kept.of(model) if kept is not None else (None, None)
    if values is None:  # (no walk kept, accelerate's hooks)
        return _walked_layer_devices(list(model.named_modules()) if walk is None else walk.named())
    devices: dict[int, torch.device] = {}
    # each index's modules' parameters, kept with the walk: only where they are now is read at each call
    for index, positions in walk.derived("layer_params", lambda: _params_per_index(walk)):
        device = next((param.device for param in at(values, positions) if param.device.type != "meta"), None)
        if device is not None:
            devices[index] = device
    return devices


def _layer_index(module: torch.nn.Module) -> int | None:
    index = module.__dict__.get("layer_idx")  # (not getattr: nn.Module's __getattr__ is slow)
    return index if is_int(index) else None


def _params_per_index(walk: ModuleWalk) -> list[tuple[int, list[int]]]:
    """[(layer_idx, its modules' parameters in order, as positions in the walk's values)]: the first one not on
    meta gives the layer's device."""
    found: dict[int, list[torch.nn.Parameter]] = {}
    for module in walk.modules():
        if (index := _layer_index(module)) is not None:
            found.setdefault(index, []).extend(module.parameters())
    return [(index, walk.positions(params)) for index, params in found.items()]


def _walked_layer_devices(named: list[tuple[str, torch.nn.Module]]) -> dict[int, torch.device]:
    hooked = {name: device for name, module in named if (device := _hook_device(module)) is not None}
    devices: dict[int, torch.device] = {}
    for name, module in named:
        index = _layer_index(module)
        if index is None or index in devices:
            continue
        device = _hooked_at(name, hooked) if hooked else None
        if device is None:
            device = next((param.device for param in module.parameters() if param.device.type != "meta"), None)
        if device is not None:
            devices[index] = device
    return devices


def _hooked_at(name: str, hooked: dict[str, torch.device]) -> torch.device | None:
    """The device of a hook on module `name` or below it, else of its nearest hooked ancestor."""
    inside = next((device for path, device in hooked.items() if path == name or path.startswith(f"{name}.")), None)
    if inside is not None:
        return inside
    while name:
        name = name.rpartition(".")[0]
        if name in hooked:
            return hooked[name]
    return None


def accelerate_hooks(module: torch.nn.Module) -> tuple:
    """The hooks accelerate attached to `module` (AlignDevicesHook, alone or in a SequentialHook); () if none."""
    hook = module.__dict__.get("_hf_hook")  # (not getattr: nn.Module's __getattr__ costs each request's weights walk)
    return () if hook is None else tuple(getattr(hook, "hooks", (hook,)))


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device of accelerate's hook on `module`."""
    devices = (getattr(hook, "execution_device", None) for hook in accelerate_hooks(module))
    device = next((device for device in devices if device is not None), None)
    return None if device is None else torch.device(device)
