"""Models accelerate dispatches with offloaded weights (meta parameters between forwards): the store reuses prefixes
exactly, sees weight changes in the offload map, and puts each layer's resumed tensors where that layer runs."""

import copy
from types import SimpleNamespace

import accelerate
import pytest
import torch
from hf_models import build

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.attention import hydragen_cache_from_store
from prefixlab.cache.devices import execution_device, layer_devices

PREFIX = list(range(3, 40))


def _generate(model, ids, cache=None):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _offloaded(model, how, folder):
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    if how == "disk_offload":
        return accelerate.disk_offload(model, str(folder), execution_device=torch.device("cpu"))
    # device_map: one hook per block, half of the blocks offloaded to disk (transformers' device_map="auto" path)
    device_map = {f"model.{name}": "cpu" for name, _ in model.model.named_children() if name != "layers"}
    device_map |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(model.config.num_hidden_layers)}
    device_map["lm_head"] = "disk"
    return accelerate.dispatch_model(model, device_map, main_device="cpu", offload_dir=str(folder))


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "device_map"])
@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_an_offloaded_model_reuses_prefixes_exactly(family, how, tmp_path):
    model = build(family)
    prompts = [torch.tensor([PREFIX + [50 + i, 60 + i]]) for i in range(3)]
    wanted = [_generate(model, ids) for ids in prompts]
    model = _offloaded(copy.deepcopy(model), how, tmp_path)
    assert execution_device(model) == torch.device("cpu")
    store = PrefixStore(model, capacity="100MB")
    for i, ids in enumerate(prompts):
        cache = HybridPrefixCache(store)
        tokens, logits = _generate(model, ids, cache)
        assert torch.equal(tokens, wanted[i][0])
        torch.testing.assert_close(logits, wanted[i][1], atol=1e-5, rtol=0)
        assert (cache.report().reused > 0) == (i > 0), cache.report()
    assert store.stats()["hit_sequences"] == 2


def test_a_weight_written_into_the_offload_map_empties_the_store():
    model = accelerate.cpu_offload(build("qwen3_5"), execution_device=torch.device("cpu"))
    store = PrefixStore(model, capacity="100MB")
    ids = torch.tensor([PREFIX + [50]])
    for _ in range(2):
        _generate(model, ids, HybridPrefixCache(store))
    assert store.stats()["hit_sequences"] == 1
    hook = model.model.layers[3].mlp.down_proj._hf_hook
    with torch.no_grad():
        hook.weights_map["weight"].mul_(1.5)
    with pytest.warns(RuntimeWarning, match="weights changed"):
        _generate(model, ids, HybridPrefixCache(store))
    assert store.stats()["hit_sequences"] == 1  # the changed weights found nothing to reuse


def _hooked(device, **more):
    return SimpleNamespace(execution_device=device, **more)


def test_each_layer_resumes_on_the_device_its_hook_runs_it_on():
    model = build("qwen3_5")
    layers = model.model.layers
    # a block placed whole by one hook (device_map), a layer whose own submodules are hooked (cpu_offload), a hook
    # inside accelerate's SequentialHook, and a layer without hooks: its parameters' device
    layers[0]._hf_hook = _hooked("meta")
    layers[1].linear_attn.in_proj_qkv._hf_hook = _hooked(torch.device("meta"))
    layers[2]._hf_hook = SimpleNamespace(hooks=[_hooked(None), _hooked("meta")])
    assert layer_devices(model) == {0: torch.device("meta"), 1: torch.device("meta"), 2: torch.device("meta"),
                                    3: torch.device("cpu")}
    assert execution_device(model) == torch.device("cpu")


def test_a_store_hit_loads_into_hydragen_on_an_offloaded_model():
    standard, hydragen = build("qwen3_5"), build("qwen3_5")
    hydragen.set_attn_implementation("hydragen")
    hydragen = accelerate.cpu_offload(hydragen, execution_device=torch.device("cpu"))
    store = PrefixStore(hydragen, capacity="100MB")
    _generate(hydragen, torch.tensor([PREFIX]), HybridPrefixCache(store))
    prompt = torch.tensor([PREFIX + [50, 60]])
    cache = hydragen_cache_from_store(store, prompt, batch_size=2)
    assert cache.get_seq_length() > 0
    tokens, logits = _generate(hydragen, prompt.repeat(2, 1), cache)
    want_tokens, want_logits = _generate(standard, prompt.repeat(2, 1))
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
