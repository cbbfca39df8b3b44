"""One walk of a model's module tree, kept while the tree is the same: the checks a store runs at every request
(`weights_version`, `layer_devices`) read a model of hundreds of modules in tens of microseconds, not milliseconds.

The tree is the same while every module's `_parameters`, `_buffers` and `_modules` dicts hold the same objects
under the same names, checked with C-level maps over flat lists: a replaced parameter or buffer (`load_state_dict(
assign=True)`, `module.weight = nn.Parameter(...)`), a replaced or added submodule or a new accelerate hook starts
a new walk. Writes into a parameter (its version counter, its storage) leave the tree as it is: `weights_version`
reads those at every call. A model with accelerate hooks is walked afresh at every call: its offloading hooks put
new tensors into `_parameters` around each forward."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch

_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOK = "_hf_hook"  # (the attribute accelerate's add_hook_to_module sets)


class ModuleWalk:
    """A model's submodules (`submodules`, as `named_modules()` yields them after the root), and what holds the tree
    together; `derived(name, compute)` keeps what is computed from the walk alone. It holds no reference to the
    root module (the walks are kept in a weak dict keyed by it)."""

    __slots__ = ("submodules", "hooked", "_root", "_dicts", "_sizes", "_owners", "_keys", "_values",
                 "_module_dicts", "_derived")

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_modules())
        self._root, self.submodules = weakref.ref(model), named[1:]
        self._module_dicts = [module.__dict__ for _, module in named]
        self.hooked = any(_HOOK in attributes for attributes in self._module_dicts)
        self._dicts = [d for _, module in named for d in (module._parameters, module._buffers, module._modules)]
        self._sizes = list(map(len, self._dicts))
        self._owners = [d for d in self._dicts for _ in d]
        self._keys = [key for d in self._dicts for key in d]
        self._values = [value for d in self._dicts for value in d.values()]
        self._derived: dict[str, object] = {}

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s tree is still the one walked (never for a model with accelerate hooks)."""
        return (not self.hooked and self._root() is model
                and list(map(len, self._dicts)) == self._sizes
                and all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
                and not any(map(operator.contains, self._module_dicts, itertools.repeat(_HOOK))))

    def modules(self) -> list[torch.nn.Module]:
        """The submodules, without their names."""
        return [module for _, module in self.submodules]

    def derived(self, name: str, compute: Callable[[], object]) -> object:
        """`compute()`, computed once per walk (a model with hooks: at every call)."""
        if name not in self._derived:
            self._derived[name] = compute()
        return self._derived[name]


def model_walk(model: torch.nn.Module) -> ModuleWalk:
    """The walk of `model`'s current module tree: the kept one while it holds, else a new one."""
    walk = _walks.get(model)
    if walk is None or not walk.holds(model):
        walk = ModuleWalk(model)
        if walk.hooked:
            _walks.pop(model, None)
        else:
            _walks[model] = walk
    return walk
