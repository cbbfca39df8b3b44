"""A parameter replaced by a new object that reuses the old one's id, storage address and version count: CPython
hands a freed object's memory to the next object, and allocators a freed block to the next tensor of its size
(`module.weight = None; module.weight = nn.Parameter(torch.randn(...))` does it within a few dozen tries on CPU;
CUDA's caching allocator at once). weights_version keyed parameters by exactly those three, so the store kept the
entries of the old weights and served them: other tokens than the updated model's."""

import warnings

import torch
from hf_models import build, generate, tokens

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.weights import weights_version


def _written_once(tensor: torch.Tensor) -> torch.nn.Parameter:
    """A new Parameter holding `tensor`'s values, written by one in-place op (version count 1)."""
    param = torch.nn.Parameter(torch.zeros_like(tensor))
    with torch.no_grad():
        param.copy_(tensor)
    return param


def _replace_in_place_of(module: torch.nn.Module, name: str, std: float) -> None:
    """Replace module.<name> (written once) by a new Parameter over the old one's memory (what an allocator handing
    the freed block back does), its values written by one in-place op, swapped into the old one's Python object
    (torch.utils.swap_tensors: what load_state_dict does under torch.__future__.set_swap_module_params_on_conversion,
    and what CPython's reuse of freed objects does by chance): id, address and version count all equal."""
    old = getattr(module, name)
    key = (id(old), old._version, old.data_ptr())
    same_memory = torch.from_numpy(old.detach().numpy())  # a new tensor (its own version counter), the old memory
    with torch.no_grad():
        same_memory.normal_(std=std)
    torch.utils.swap_tensors(old, torch.nn.Parameter(same_memory))
    new = getattr(module, name)
    assert (id(new), new._version, new.data_ptr()) == key  # (the collision this test is about)


def test_a_replaced_parameter_reusing_id_address_and_version_changes_the_weights_version():
    module = torch.nn.Sequential(torch.nn.Linear(8, 4))
    module[0].weight = _written_once(torch.randn(4, 8))
    before = weights_version(module)
    _replace_in_place_of(module[0], "weight", 3.0)
    assert weights_version(module) != before


def test_the_store_drops_the_entries_of_replaced_weights():
    model = build("qwen3_5")
    prompt = tokens(1, 24, seed=1)
    down = model.model.layers[0].mlp.down_proj
    down.weight = _written_once(down.weight.detach())
    store = PrefixStore(model, capacity="64MB", block_size=4)
    generate(model, prompt[:, :20], HybridPrefixCache(store))
    _replace_in_place_of(down, "weight", 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("the model's weights changed": the store emptied)
        got = generate(model, prompt, HybridPrefixCache(store))
    assert torch.equal(got, generate(model, prompt))
    store.close()
