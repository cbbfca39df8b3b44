"""Bad input at the entry points tests/test_refusals_unchanged.py does not reach: the default store's options
(`HybridPrefixCache.for_model`, `PrefixStore.default_for`), Hydragen caches built from a store, the multimodal
model's images, and the fleet's in-process calls that touch a store. Each refusal is one of prefixlab's errors (or
transformers' own), leaves the store's snapshot as it was, and the next valid request is the uncached model's."""

import numpy as np
import pytest
import torch
from hf_models import build, generate, tokens
from multimodal_helpers import END, IMAGE, START, TEXT, image_inputs
from multimodal_helpers import build_model as build_multimodal
from persist_helpers import model_state
from test_refusals_unchanged import refused, still_exact

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.attention import hydragen_cache_from_store
from prefixlab.cache.defaults import default_store
from prefixlab.errors import InvalidInputError, ModelMismatchError, PrefixlabError
from prefixlab.fleet import serve, siblings

PROMPT = tokens(1, 20, seed=0)


def filled(model, prompt=PROMPT, **options):
    """(model, an open store holding `prompt`'s entries, a probe prompt, its uncached greedy output, None): what
    still_exact takes."""
    store = PrefixStore(model, capacity="64MB", block_size=4, **options)
    generate(model, prompt, HybridPrefixCache(store))
    store.flush()
    probe = prompt[:, :16].clone()
    return model, store, probe, generate(model, probe), None


BAD_OPTIONS = [({"capacity": "lots"}, "capacity"), ({"capacity": "1KB"}, "default store"),
               ({"policy": "lru"}, "policy"), ({"block_size": 0}, "default store"), ({"patch": "no"}, "patch"),
               ({"offload_capacity": "x"}, "offload_capacity"), ({"flavour": 1}, "default store")]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_default_store_options_are_refused_and_change_nothing(family):
    """With a default store open: options it was not built with, or invalid ones, are refused by for_model and
    default_for; without one, a store that cannot be built leaves the model without a store and its hooks."""
    model = build(family)
    bare = model_state(model)
    for options, _ in BAD_OPTIONS[:1] + BAD_OPTIONS[2:]:  # no default store yet: none is built, no hook is left
        for call in (PrefixStore.default_for, HybridPrefixCache.for_model):
            with pytest.raises(InvalidInputError):
                call(model, **options)
            assert default_store(model) is None and model_state(model) == bare
    for namespace in ("", None, b"x"):  # (was refused after the default store was built: its hooks were left)
        with pytest.raises(InvalidInputError, match="namespace"):
            HybridPrefixCache.for_model(model, namespace=namespace)
        assert default_store(model) is None and model_state(model) == bare
    served = filled(model)
    store = served[1]
    assert PrefixStore.default_for(model) is store
    for options, match in BAD_OPTIONS:
        refused(store, lambda o=options: PrefixStore.default_for(model, **o), InvalidInputError, match)
        refused(store, lambda o=options: HybridPrefixCache.for_model(model, **o), InvalidInputError, match)
    refused(store, lambda: HybridPrefixCache.for_model(model, namespace=3), InvalidInputError, "namespace")
    refused(store, lambda: HybridPrefixCache.for_model("model"), InvalidInputError, "transformers model")
    still_exact(served)
    store.close()


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def hydragen_served(request):
    model = build(request.param)
    model.set_attn_implementation("hydragen")  # (no HydragenCache: SDPA bit for bit)
    served = (*filled(model)[:4], request.param)
    yield served
    served[1].close()


def _hydragen_exact(model, store, prompt, batch=2):
    """A valid Hydragen request of `model` over the store: every row the uncached model's greedy tokens."""
    expected = generate(model, prompt)
    cache = hydragen_cache_from_store(store, prompt, batch_size=batch, model=model)
    out = generate(model, prompt.repeat(batch, 1), cache)
    assert cache.get_seq_length() > 0
    assert all(torch.equal(row[None], expected) for row in out)


def test_hydragen_from_a_store_refuses_bad_inputs_and_changes_nothing(hydragen_served):
    model, store, probe = hydragen_served[:3]
    good = probe
    other = build("lfm2" if model.config.model_type != "lfm2" else "llama")
    for call, error, match in [
        (lambda: hydragen_cache_from_store("store", good, 2), InvalidInputError, "PrefixStore"),
        (lambda: hydragen_cache_from_store(store, good[0], 2), InvalidInputError, r"\(1, T>0\)"),  # 1-D
        (lambda: hydragen_cache_from_store(store, good.repeat(2, 1), 2), InvalidInputError, r"\(1, T>0\)"),
        (lambda: hydragen_cache_from_store(store, good[:, :0], 2), InvalidInputError, r"\(1, T>0\)"),
        (lambda: hydragen_cache_from_store(store, good.float(), 2), InvalidInputError, r"\(1, T>0\)"),
        (lambda: hydragen_cache_from_store(store, good.tolist(), 2), InvalidInputError, r"\(1, T>0\)"),
        (lambda: hydragen_cache_from_store(store, good + 1000, 2), InvalidInputError, "not a token id"),
        (lambda: hydragen_cache_from_store(store, good - 1000, 2), InvalidInputError, "not a token id"),
        (lambda: hydragen_cache_from_store(store, good.bool(), 2), InvalidInputError, "integer token ids"),
        (lambda: hydragen_cache_from_store(store, good, 0), InvalidInputError, "batch_size"),
        (lambda: hydragen_cache_from_store(store, good, -2), InvalidInputError, "batch_size"),
        (lambda: hydragen_cache_from_store(store, good, 1.5), InvalidInputError, "batch_size"),
        (lambda: hydragen_cache_from_store(store, good, "2"), InvalidInputError, "batch_size"),
        (lambda: hydragen_cache_from_store(store, good, None), InvalidInputError, "batch_size"),
        (lambda: hydragen_cache_from_store(store, good, 2, namespace=""), InvalidInputError, "namespace"),
        (lambda: hydragen_cache_from_store(store, good, 2, namespace=3), InvalidInputError, "namespace"),
        (lambda: hydragen_cache_from_store(store, good, 2, model=other), ModelMismatchError, "another model"),
    ]:
        refused(store, call, error, match)
    # the same config, other weights: the store's KV and states are not this model's (were served: other outputs)
    retrained = build(hydragen_served[4], seed=1)
    retrained.set_attn_implementation("hydragen")
    refused(store, lambda: hydragen_cache_from_store(store, good, 2, model=retrained), ModelMismatchError, "weights")
    closed = PrefixStore(model, capacity="1MB")
    closed.close()
    refused(store, lambda: hydragen_cache_from_store(closed, good, 2), PrefixlabError, "closed")
    _hydragen_exact(model, store, probe)
    twin = build(hydragen_served[4])  # another object with the same weights: served
    twin.set_attn_implementation("hydragen")
    _hydragen_exact(twin, store, probe)
    still_exact(hydragen_served)


BAD_PROMPT_TOKENS = [[5, -1, 7], [5, 10**6], [[5, 6], [7, 8]], "abc", None, [5.5, 6.5], np.array([5.0, 6.0]),
                     [True, False], [2**64 - 1], []]


def test_the_fleets_store_calls_refuse_bad_prompt_tokens_and_change_nothing(hydragen_served):
    """Before: float and bool ids were truncated to ints, served and admitted; a str, None, a 2**64 - 1 id or a 2-D
    list failed with a raw TypeError / ValueError (generate's "attention_mask ... must be 2D")."""
    model, store = hydragen_served[:2]
    good = hydragen_served[2][0].numpy()
    for bad in BAD_PROMPT_TOKENS:
        refused(store, lambda b=bad: serve.generate(model, store, b, 2), InvalidInputError)
        refused(store, lambda b=bad: serve.prime(model, store, b), InvalidInputError)
    rows = [np.concatenate([good, [7, 8]]), np.concatenate([good, [9, 10]])]
    for bad_rows, shared in [([np.array([5, -1, 7, 8]), np.array([5, -1, 7, 9])], 2),
                             ([np.array([5, 10**6, 7, 8]), np.array([5, 10**6, 7, 9])], 2),
                             ([rows[0], np.concatenate([good, [9, 10**6]])], len(good)),  # past the head
                             ([good + 0.5, good + 0.5], 4), ([good[None], good[None]], 4), ([], 2),
                             (rows, len(good) + 2), (rows, -1), (rows, 1.5)]:
        refused(store, lambda r=bad_rows, s=shared: siblings.generate_group(model, store, r, s, [2, 2]),
                InvalidInputError)
    for new_tokens, stops in [([2, 2, 2], None), ([2], None), ([0, 2], None), ([-1, 2], None), ([2.5, 2], None),
                              ([2, 2], [[5]])]:  # (were an IndexError after the lookup, or a row dropped or cut)
        refused(store, lambda n=new_tokens, t=stops: siblings.generate_group(model, store, rows, len(good), n,
                                                                            stop_token_ids=t), InvalidInputError)
    result = siblings.generate_group(model, store, rows, len(good), [3, 3])
    assert result.outputs == [serve.generate_uncached(model, r, 3) for r in rows]
    still_exact(hydragen_served)


@pytest.fixture(scope="module")
def multimodal():
    model = build_multimodal()
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB", block_size=4)
    model(**image_inputs(prompt, 1), past_key_values=HybridPrefixCache(store))
    store.flush()
    yield model, store, prompt
    store.close()


def test_malformed_images_are_refused_and_change_nothing(multimodal):
    """Pixels or grids that do not fit the prompt: InvalidInputError, or the vision tower's own RuntimeError. Before,
    pixels without their grid were looked up (nodes touched, counted) and then failed in the model (AttributeError)."""
    model, store, prompt = multimodal
    good = image_inputs(prompt, 1)
    pixels, grid = good["pixel_values"], good["image_grid_thw"]
    for change, error in [({"pixel_values": pixels[:8]}, RuntimeError),
                          ({"pixel_values": pixels[:, :10]}, RuntimeError),
                          ({"image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]])}, RuntimeError),
                          ({"image_grid_thw": torch.tensor([[1, 2, 2]])}, InvalidInputError),
                          ({"image_grid_thw": torch.tensor([[2, 4, 4]])}, InvalidInputError),
                          ({"image_grid_thw": grid.float()}, InvalidInputError),
                          ({"image_grid_thw": torch.tensor([[1, -4, -4]])}, InvalidInputError),
                          ({"image_grid_thw": grid[0]}, InvalidInputError),
                          ({"image_grid_thw": None}, InvalidInputError)]:
        inputs = good | change
        refused(store, lambda i=inputs: model(**i, past_key_values=HybridPrefixCache(store)), error)
        # through generate: transformers refuses each itself, before the cache sees the request
        refused(store, lambda i=inputs: model.generate(**i, past_key_values=HybridPrefixCache(store), max_new_tokens=2,
                                                       do_sample=False, pad_token_id=0),
                (RuntimeError, AttributeError, IndexError, InvalidInputError))
    expected = model(**good).logits
    cache = HybridPrefixCache(store)
    got = model(**good, past_key_values=cache).logits
    torch.testing.assert_close(got, expected[:, -got.shape[1]:], rtol=0, atol=1e-5)
    assert cache.reused_tokens > prompt.index(END)
    store.flush()
    store.core.check_invariants()
