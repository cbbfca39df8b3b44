"""A saved store keeps its settled alpha (cache/persist.py `_restore_alphas`): loaded as it was saved, it runs with
the tuned (or fixed) alpha and does not tune again; loaded otherwise, or saved mid-tuning, it tunes anew."""

import numpy as np
import pytest
import torch
from hf_models import build
from persist_helpers import FAMILY, generate, stream

from prefixlab import PrefixStore

OPTIONS = {"capacity": 60_000, "block_size": 4, "policy": "dp", "tuning_lag_requests": 0}


@pytest.fixture(scope="module")
def model():
    return build(FAMILY)


def served(model, store, prompts) -> list[torch.Tensor]:
    return [generate(model, prompt, store)[0] for prompt in prompts]


def test_a_store_loaded_as_saved_keeps_its_tuned_alpha_and_does_not_tune_again(model, tmp_path):
    store = PrefixStore(model, **OPTIONS)
    served(model, store, stream(0, 8))
    assert store.core.bootstrap is None and store.core.alpha > 0  # tuned (a test that could not fail otherwise)
    path = tmp_path / "store.safetensors"
    store.save(path)
    loaded = PrefixStore.load(path, model, tuning_lag_requests=0)
    assert loaded.core.alpha == store.core.alpha and loaded.core.bootstrap is None
    later = stream(1, 12)
    assert all(torch.equal(a, b) for a, b in
               zip(served(model, loaded, later), [generate(model, p)[0] for p in later], strict=True))
    assert loaded.core.alpha == store.core.alpha  # no second tuning
    fresh = PrefixStore.load(path, model, tuning_lag_requests=0, capacity=61_000)  # another budget: tunes anew
    assert fresh.core.alpha == 0 and fresh.core.bootstrap is not None
    for other in ({"policy": "marconi"}, {"block_size": 8}, {"alpha": None}):
        again = PrefixStore.load(path, model, tuning_lag_requests=0, **other)
        assert again.core.bootstrap is not None, other
        again.close()
    for one in (store, loaded, fresh):
        one.close()


def test_a_fixed_alpha_is_kept_and_a_store_saved_mid_tuning_tunes_anew(model, tmp_path):
    fixed = PrefixStore(model, **OPTIONS | {"alpha": 1.3})
    served(model, fixed, stream(2, 2))
    fixed.save(tmp_path / "fixed.safetensors")
    loaded = PrefixStore.load(tmp_path / "fixed.safetensors", model)
    assert loaded.core.alpha == 1.3 and loaded.core.bootstrap is None
    assert PrefixStore.load(tmp_path / "fixed.safetensors", model, alpha=0.2).core.alpha == 0.2
    untuned = PrefixStore(model, **OPTIONS)
    served(model, untuned, stream(3, 1))
    assert untuned.core.bootstrap is not None
    untuned.save(tmp_path / "untuned.safetensors")
    assert PrefixStore.load(tmp_path / "untuned.safetensors", model).core.bootstrap is not None
    for one in (fixed, loaded, untuned):
        one.close()


def test_each_tier_keeps_its_own_alpha(model, tmp_path):
    store = PrefixStore(model, **OPTIONS | {"offload_capacity": 120_000})
    served(model, store, stream(4, 30))
    alphas = (store.core.alpha, store.offload.alpha)
    assert store.core.bootstrap is None and store.offload.bootstrap is None and alphas[0] != alphas[1]
    store.save(tmp_path / "store.safetensors")
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    assert (loaded.core.alpha, loaded.offload.alpha) == alphas
    assert loaded.core.bootstrap is None and loaded.offload.bootstrap is None
    device_only = PrefixStore.load(tmp_path / "store.safetensors", model, offload_capacity=None)
    assert device_only.core.alpha == alphas[0]  # its device tier is the one saved
    for one in (store, loaded, device_only):
        one.close()


def test_a_load_that_evicts_does_not_tune_on_its_own_entries(model, tmp_path):
    """Entries admitted before any lookup (a load into a smaller budget, evicting as it goes) are not traffic: they
    neither open the alpha window nor fill it (they did, and the load tuned alpha on them and never again)."""
    store = PrefixStore(model, **OPTIONS | {"capacity": 200_000})
    served(model, store, stream(0, 6))
    assert store.core.bootstrap is not None  # (nothing settled to keep: the loaded store must tune on its own)
    store.save(tmp_path / "store.safetensors")
    small = PrefixStore.load(tmp_path / "store.safetensors", model, capacity=100_000, tuning_lag_requests=0)
    assert small.core.evictions > 0  # (the load evicted: the case at hand)
    window = small.core.bootstrap
    assert window is not None and window.tune_at is None and not window.requests and small.core.alpha == 0
    served(model, small, stream(1, 1))
    small.flush()  # (a request is admitted at the store's next use)
    assert len(small.core.bootstrap.requests) == 1  # its first request is the window's first
    for one in (store, small):
        one.close()


def test_a_numpy_alpha_is_saved_and_kept(model, tmp_path):
    """alpha=np.float32(...) is a valid alpha (numpy scalars are taken): save failed with json's 'Object of type
    float32 is not JSON serializable' once the settled alpha went into the header."""
    store = PrefixStore(model, **OPTIONS | {"alpha": np.float32(1.5)})
    served(model, store, stream(2, 2))
    store.save(tmp_path / "store.safetensors")
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    assert loaded.core.alpha == 1.5 and loaded.core.bootstrap is None
    for one in (store, loaded):
        one.close()
