"""HydragenCache.load_shared_prefix checks every tensor against the model's layers BEFORE it changes anything: a
prefix of the wrong shape, dtype or device is refused with what to give, and the cache stays empty and usable (a
correct load then generates the uncached model's tokens). It took any (kv_heads, P, D) keys and any states: the
first attention layer then raised inside generate, after the recurrent layers had already run on the loaded
states (the cache half-updated)."""

import math

import pytest
import torch
from hf_models import FAMILIES, build, tokens
from hydragen_helpers import prefix_tensors
from test_costmodel_hf import TINY, run_tiny
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from prefixlab.attention import HydragenCache, prefix_checks
from prefixlab.attention.hf_cache import SharedPrefixLayer
from prefixlab.attention.prefix_checks import expected_shapes
from prefixlab.errors import InvalidInputError

PREFIX, PROMPT = 6, 9


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "lfm2"])
def loaded(request):
    """(standard model, hydragen model with the same weights, prompt, the prefix tensors of its first PREFIX tokens)."""
    standard, hydragen = build(request.param), build(request.param)
    hydragen.set_attn_implementation("hydragen")
    prompt = tokens(1, PROMPT, seed=3)
    return standard, hydragen, prompt, prefix_tensors(standard, prompt[:, :PREFIX])


def _greedy(model, ids, cache=None):
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _assert_empty_then_usable(cache, standard, hydragen, prompt, tensors):
    """A refused load left nothing behind: a correct load of the same cache then generates the uncached tokens."""
    assert cache.shared_bytes() == 0 and cache.get_seq_length() == 0 and cache.expected_batch is None
    assert not any(_state_tensors(layer) for layer in cache.layers)
    cache.load_shared_prefix(**tensors, batch_size=2)
    ids = prompt.repeat(2, 1)
    assert torch.equal(_greedy(hydragen, ids, cache), _greedy(standard, ids))


def _edited(tensors, kinds, layer_pick, edit):
    """`tensors` with `edit` applied to the `kinds` tensors of one layer (`layer_pick`: "first" / "last") or all."""
    edited = dict(tensors)
    for kind in kinds:
        layers = sorted(tensors[kind])
        picked = layers if layer_pick == "all" else [layers[0 if layer_pick == "first" else -1]]
        edited[kind] = {i: edit(t) if i in picked else t for i, t in tensors[kind].items()}
    return edited


def _heads(t):  # one more KV head (or channel) than the model has
    return torch.cat([t, t[:, :1]], dim=1)


def _widen(t):  # one more column on the last axis (head dim, conv kernel, state width)
    return torch.cat([t, t[..., :1]], dim=-1)


BAD = {
    "kv heads, last layer": (("keys", "values"), "last", _heads, "kv_heads"),
    "kv heads, every layer": (("keys", "values"), "all", _heads, "kv_heads"),
    "head dim, every layer": (("keys", "values"), "all", _widen, "head_dim"),
    "value dtype": (("values",), "last", lambda t: t.double(), "dtype"),
    "key dtype, every layer": (("keys",), "all", lambda t: t.double(), "dtype"),
    "conv channels, last layer": (("conv_states",), "last", _heads, "conv_states"),
    "conv channels, every layer": (("conv_states",), "all", _heads, "conv_states"),
    "conv kernel, every layer": (("conv_states",), "all", _widen, "conv_states"),
    "conv dtype, first layer": (("conv_states",), "first", lambda t: t.double(), "dtype"),
    "recurrent state, last layer": (("recurrent_states",), "last", _widen, "recurrent_states"),
    "recurrent state, every layer": (("recurrent_states",), "all", _widen, "recurrent_states"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_prefix_of_the_wrong_shape_or_dtype_is_refused_and_leaves_the_cache_empty(loaded, bad):
    standard, hydragen, prompt, tensors = loaded
    kinds, layer_pick, edit, match = BAD[bad]
    if not tensors[kinds[0]]:
        pytest.skip(f"{type(standard).__name__} has no {kinds[0]}")
    cache = HydragenCache(hydragen.config)
    with pytest.raises(InvalidInputError, match=match):
        cache.load_shared_prefix(**_edited(tensors, kinds, layer_pick, edit), batch_size=2)
    _assert_empty_then_usable(cache, standard, hydragen, prompt, tensors)


def test_without_shapes_from_the_config_the_layers_must_agree(loaded, monkeypatch):
    """A model type the cost model does not read gives no shapes: one layer unlike the others is still refused."""
    standard, hydragen, prompt, tensors = loaded
    monkeypatch.setattr(prefix_checks, "expected_shapes", lambda config: (None, None))
    for bad in ("kv heads, last layer", "conv channels, last layer", "recurrent state, last layer"):
        kinds, layer_pick, edit, match = BAD[bad]
        if len(tensors[kinds[0]]) > 1:
            cache = HydragenCache(hydragen.config)
            with pytest.raises(InvalidInputError, match=match):
                cache.load_shared_prefix(**_edited(tensors, kinds, layer_pick, edit), batch_size=2)
            assert cache.shared_bytes() == 0 and cache.expected_batch is None
    _assert_empty_then_usable(HydragenCache(hydragen.config), standard, hydragen, prompt, tensors)


def test_a_prefix_in_another_dtype_than_the_model_is_refused_before_any_layer_runs(loaded):
    """Every tensor in float64 agrees with itself but not with the fp32 model: the first layer the forward reaches
    (recurrent or attention) refuses it, before any layer has changed, and the loaded prefix is left as it was."""
    standard, hydragen, prompt, tensors = loaded
    doubled = {kind: {i: t.double() for i, t in per_layer.items()} for kind, per_layer in tensors.items()}
    cache = HydragenCache(hydragen.config)
    cache.load_shared_prefix(**doubled, batch_size=2)
    held = [t.clone() for layer in cache.layers for t in _state_tensors(layer)]
    with pytest.raises(InvalidInputError, match="float64.*float32"):
        _greedy(hydragen, prompt.repeat(2, 1), cache)
    assert all(torch.equal(a, b) for a, b in zip(held, (t for layer in cache.layers for t in _state_tensors(layer)),
                                                   strict=True))
    assert all(not layer.is_initialized for layer in cache.layers if isinstance(layer, SharedPrefixLayer))
    cache.reset()
    _assert_empty_then_usable(cache, standard, hydragen, prompt, tensors)


def _state_tensors(layer):
    """The tensors a cache layer holds: its shared levels, or the states of a recurrent layer that has them."""
    if isinstance(layer, SharedPrefixLayer):
        return [t for level in layer.levels for t in (level.keys, level.values)]
    if not layer.has_previous_state[0]:
        return []
    return [t for states in (layer.conv_states, layer.recurrent_states) for t in
            (states.values() if isinstance(states, dict) else states) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_hydragen_serves_loads_its_own_prefix(family):
    """The expected shapes come from the cost model's reading of each config: the tensors of every family's own
    forward pass them (none refused that was right)."""
    model = build(family)
    model.set_attn_implementation("hydragen")
    try:
        cache = HydragenCache(model.config)
        tensors = prefix_tensors(model, tokens(1, PREFIX))
    except InvalidInputError:
        pytest.skip(f"{family}: HydragenCache does not serve it")
    attention = {i for i, layer in enumerate(cache.layers) if isinstance(layer, SharedPrefixLayer)}
    if not attention:
        pytest.skip(f"{family}: no full-attention layer, so no prefix to share (load_shared_prefix takes none)")
    for side in ("keys", "values"):  # (hybrid layers, attention + state in one, keep their own KV per sequence)
        tensors[side] = {i: t for i, t in tensors[side].items() if i in attention}
    cache.load_shared_prefix(**tensors, batch_size=2)
    assert cache.get_seq_length() == PREFIX


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_expected_shapes_are_those_of_every_supported_models_own_cache(model_type):
    """The shapes load_shared_prefix expects, read from each supported model type's config (head_dim apart from
    hidden / heads, conv kernels of 3 and 5, Mamba1 and Mamba2 layouts), are those its own forward caches."""
    model, cache = run_tiny(model_type, torch.float32)
    kv, states = expected_shapes(model.config)
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and kv is not None and getattr(layer, "keys", None) is not None:
            assert (layer.keys.shape[1], layer.keys.shape[3]) == kv
        if isinstance(layer, LinearAttentionCacheLayerMixin) and states is not None:
            conv, held = layer.conv_states.get(0), layer.recurrent_states.get(0)
            assert conv is None or tuple(conv.shape[1:]) == states[0]
            assert held is None or states[1] is None or math.prod(held.shape[1:]) == states[1]


def test_states_given_with_an_empty_prefix_are_refused(loaded):
    """A 0-token prefix has no state after it: states given with one were silently dropped (generate then ran the
    recurrent layers from fresh states, not from the ones given); refused, the cache left empty and usable."""
    standard, hydragen, prompt, tensors = loaded
    if not tensors["conv_states"]:
        pytest.skip(f"{type(standard).__name__} has no recurrent layer")
    empty = {kind: {i: t[..., :0, :] for i, t in tensors[kind].items()} for kind in ("keys", "values")}
    cache = HydragenCache(hydragen.config)
    with pytest.raises(InvalidInputError, match="0-token prefix"):
        cache.load_shared_prefix(**tensors | empty, batch_size=2)
    _assert_empty_then_usable(cache, standard, hydragen, prompt, tensors)
    cache = HydragenCache(hydragen.config)  # (without states: a miss, as before)
    cache.load_shared_prefix(**empty, batch_size=2)
    assert cache.get_seq_length() == 0
