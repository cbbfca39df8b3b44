"""One walk of a model's module tree, kept while the tree is the same: the checks a store runs at every request
(`weights_version`, `layer_devices`) read a model of hundreds of modules in a few hundred microseconds, not
milliseconds.

The tree is the same while every module's `_parameters`, `_buffers` and `_modules` dicts hold the same objects
under the same names, checked with C-level maps over flat lists: a replaced parameter or buffer (`load_state_dict(
assign=True)`, `module.weight = nn.Parameter(...)`), a replaced or added submodule or a new accelerate hook starts
a new walk. Writes into a parameter (its version counter, its storage) leave the tree as it is: `weights_version`
reads those at every call. A model with accelerate hooks is walked afresh at every call: its offloading hooks put
new tensors into `_parameters` around each forward.

A walk references modules weakly and tensors not at all (by id, as `weights_version` always has; a weak reference
to a tensor would stop `torch.utils.swap_tensors`, which `module.to()` may use): weights replaced under a store are
freed at once. What is derived from a walk (`derived`) holds positions in the tree's current objects (`current`)."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch

_HOOK = "_hf_hook"  # (the attribute accelerate's add_hook_to_module sets)
_DICTS = operator.itemgetter("_parameters", "_buffers", "_modules")  # (read from a module's __dict__)
_ATTRIBUTES = operator.attrgetter("__dict__")
_MISSING = object()


class ModuleWalk:
    """A model's modules as `named_modules()` yields them, and what holds the tree together: the objects of every
    module's `_parameters`, `_buffers` and `_modules` dicts (by id)."""

    __slots__ = ("hooked", "_names", "_modules", "_sizes", "_owners", "_keys", "_ids", "_derived")

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_modules())
        self._names = [name for name, _ in named]
        self._modules = [weakref.ref(module) for _, module in named]
        self.hooked = any(_HOOK in module.__dict__ for _, module in named)
        dicts = [d for _, module in named for d in _DICTS(module.__dict__)]
        self._sizes = list(map(len, dicts))
        self._owners = [i for i, d in enumerate(dicts) for _ in d]  # (indexes: a dict cannot be referenced weakly)
        self._keys = [key for d in dicts for key in d]
        self._ids = [id(value) for d in dicts for value in d.values()]
        self._derived: dict[str, object] = {}

    def modules(self) -> list[torch.nn.Module]:
        """The modules, the root first (as `named_modules()`; only while the walk holds)."""
        return list(map(operator.call, self._modules))

    def named(self) -> list[tuple[str, torch.nn.Module]]:
        return list(zip(self._names, self.modules(), strict=True))

    def current(self, model: torch.nn.Module) -> list | None:
        """The objects of the modules' dicts now, in walk order, if `model`'s tree is still the one walked (never
        for a model with accelerate hooks); else None."""
        modules = self.modules()
        if self.hooked or modules[0] is not model or None in modules:
            return None
        attributes = list(map(_ATTRIBUTES, modules))
        dicts = list(itertools.chain.from_iterable(map(_DICTS, attributes)))
        if list(map(len, dicts)) != self._sizes or any(map(operator.contains, attributes, itertools.repeat(_HOOK))):
            return None
        values = list(map(dict.get, map(dicts.__getitem__, self._owners), self._keys, itertools.repeat(_MISSING)))
        return values if list(map(id, values)) == self._ids else None

    def positions(self, objects: list) -> list[int]:
        """Where each of `objects` (found in the tree when walked) sits in `current`'s list."""
        first: dict[int, int] = {}
        for i, identity in enumerate(self._ids):
            first.setdefault(identity, i)
        return [first[id(obj)] for obj in objects]

    def derived(self, name: str, compute: Callable[[], object]) -> object:
        """`compute()`, computed once per walk (a model with hooks: at every call); keep positions, not objects."""
        if name not in self._derived:
            self._derived[name] = compute()
        return self._derived[name]


def at(values: list, positions: list[int]) -> list:
    """The objects at `positions` of `values` (a walk's `current`)."""
    return list(map(values.__getitem__, positions))


class KeptWalk:
    """The walk of one model, kept by its owner (a PrefixStore) between calls: `of(model)` gives the kept walk
    while it holds, else walks again."""

    __slots__ = ("walk",)

    def __init__(self) -> None:
        self.walk: ModuleWalk | None = None

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of the walk `of` last gave for `model` (a model with accelerate hooks: walked now)."""
        return self.walk.modules() if self.walk is not None else list(model.modules())

    def of(self, model: torch.nn.Module) -> tuple[ModuleWalk, list | None]:
        """(the walk, its `current` objects; None for a model with accelerate hooks)."""
        if self.walk is not None and (values := self.walk.current(model)) is not None:
            return self.walk, values
        walk = ModuleWalk(model)
        self.walk = None if walk.hooked else walk
        return walk, None if walk.hooked else walk.current(model)
