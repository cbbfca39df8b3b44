"""The module walk a store keeps between requests (prefixlab/cache/walk.py): reused while the model's tree is the
same, walked again after any change of its tree, never keeping the model alive."""

from __future__ import annotations

import gc
import weakref

import torch
from hf_models import build

from prefixlab.cache.devices import layer_devices
from prefixlab.cache.model_info import weights_version
from prefixlab.cache.walk import model_walk


def test_the_walk_is_kept_while_only_weights_values_change():
    model = build("qwen3_5")
    walk, version = model_walk(model), weights_version(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # an in-place write: same tree, a new version
    assert model_walk(model) is walk and weights_version(model) != version


def test_every_change_of_the_tree_starts_a_new_walk():
    model = build("qwen3_5")
    edits = [  # (each but the Identity changes what the weights are: the version changes too)
        lambda: setattr(model.lm_head, "weight", torch.nn.Parameter(model.lm_head.weight.detach().clone())),
        lambda: model.model.layers[1].register_buffer("extra", torch.zeros(2)),
        lambda: model.model.layers[1].register_buffer("extra", torch.ones(2)),
        lambda: setattr(model.model.layers[0], "mlp", build("qwen3_5", seed=2).model.layers[0].mlp),
        lambda: model.model.norm._parameters.__setitem__("weight", torch.nn.Parameter(torch.ones(64))),
        lambda: model.model.layers.append(torch.nn.Identity()),
        lambda: delattr(model.model.layers[0].mlp, "up_proj"),
    ]
    for number, edit in enumerate(edits):
        walk, version = model_walk(model), weights_version(model)
        edit()
        assert model_walk(model) is not walk
        assert (weights_version(model) == version) == (number == 5)


def test_a_changed_parameter_changes_the_version_as_a_fresh_walk_finds():
    model = build("bamba")
    weights_version(model)
    model.model.layers[0].mamba.out_proj.weight = torch.nn.Parameter(torch.zeros_like(
        model.model.layers[0].mamba.out_proj.weight))
    cached = weights_version(model)
    model_walk(model).__init__(model)  # a fresh walk of the same tree gives the same version
    assert weights_version(model) == cached


def test_layer_devices_follow_a_layer_moved_after_the_walk():
    model = build("qwen3_5")
    before = layer_devices(model)
    assert set(before) == {0, 1, 2, 3} and all(device.type == "cpu" for device in before.values())
    walk = model_walk(model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # .to() keeps the parameter objects: same tree
    try:
        model.model.layers[2].to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert model_walk(model) is walk
    assert set(layer_devices(model)) == {0, 1, 3}


def test_the_walk_does_not_keep_the_model_alive():
    model = build("llama")
    weights_version(model), layer_devices(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
