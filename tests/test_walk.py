"""The module walk a store keeps between requests (prefixlab/cache/walk.py): reused while the model's tree is the
same, walked again after any change of its tree."""

from __future__ import annotations

import torch
from hf_models import build

from prefixlab.cache.devices import layer_devices
from prefixlab.cache.walk import KeptWalk
from prefixlab.cache.weights import weights_version


def test_the_walk_is_kept_while_only_weights_values_change():
    model = build("qwen3_5")
    kept = KeptWalk()
    walk, version = kept.of(model)[0], weights_version(model, kept)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # an in-place write: same tree, a new version
    assert kept.of(model)[0] is walk and weights_version(model, kept) != version


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
    kept = KeptWalk()
    for number, edit in enumerate(edits):
        walk, version = kept.of(model)[0], weights_version(model, kept)
        edit()
        assert kept.of(model)[0] is not walk
        assert (weights_version(model, kept) == version) == (number == 5)


def test_a_changed_parameter_changes_the_version_as_a_fresh_walk_finds():
    model = build("bamba")
    kept = KeptWalk()
    weights_version(model, kept)
    model.model.layers[0].mamba.out_proj.weight = torch.nn.Parameter(torch.zeros_like(
        model.model.layers[0].mamba.out_proj.weight))
    assert weights_version(model, kept) == weights_version(model)  # as a fresh walk finds it


def test_layer_devices_follow_a_layer_moved_after_the_walk():
    model, kept = build("qwen3_5"), KeptWalk()
    before = layer_devices(model, kept)
    assert set(before) == {0, 1, 2, 3} and all(device.type == "cpu" for device in before.values())
    walk = kept.of(model)[0]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # .to() keeps the parameter objects: same tree
    try:
        model.model.layers[2].to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert kept.of(model)[0] is walk
    assert set(layer_devices(model, kept)) == {0, 1, 3}


def test_a_store_keeps_neither_weights_replaced_under_it_nor_a_swap_from_working():
    """The kept walk holds no tensor: weights a sync replaced (`load_state_dict(assign=True)`) are freed at once,
    not at the store's next request, and `torch.utils.swap_tensors` (which `module.to()` may use, and which a weak
    reference to a tensor stops) still works on the store's model."""
    import gc
    import weakref

    from prefixlab import HybridPrefixCache, PrefixStore

    model = build("qwen3_5")
    store = PrefixStore(model)
    model.generate(torch.randint(3, 100, (1, 12)), past_key_values=HybridPrefixCache(store), max_new_tokens=2)
    old = [weakref.ref(param) for param in model.parameters()]
    model.load_state_dict(build("qwen3_5", seed=1).state_dict(), assign=True)
    gc.collect()
    assert not any(ref() is not None for ref in old)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64).to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    store.close()
