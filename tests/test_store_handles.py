"""A store's and a model's handles: a store dropped without close() is collected and gives its place as default
to the next; the module torch.compile returns is refused, and a hooked model is not pickled."""

import pytest
import torch
from hf_models import build

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


def test_a_first_store_dropped_without_close_is_collected_and_the_next_one_is_the_default(model):
    """The first store of a model (its default) was held by the model: dropped, it kept its budget, hooks and patch
    for good and unbound caches bound to it."""
    import gc
    import weakref

    from prefixlab.cache.defaults import default_store
    from prefixlab.cache.hooks import is_attached

    first = PrefixStore(model, capacity="1MB")
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None and default_store(model) is None
    second = PrefixStore(model, capacity="2MB")  # (gives the dropped store's hooks and patch back first)
    assert default_store(model) is second and HybridPrefixCache.for_model(model).store is second
    second.close()
    assert not is_attached(model) and not getattr(model, "prefixlab_patched", False)


def test_the_compiled_wrapper_is_refused_and_the_model_left_as_it_was(model):
    """torch.compile's module passes attribute writes through to the model: a store or patch on it marked the model
    patched without patching it, stacked generate wrappers, and served Jamba inexactly."""
    import pickle

    import prefixlab
    from prefixlab.recurrent import patch

    compiled = torch.compile(model)
    for call in (lambda: PrefixStore(compiled), lambda: prefixlab.patch(compiled), lambda: patch(compiled)):
        with pytest.raises(InvalidInputError, match="torch.compile returned"):
            call()
    assert "generate" not in vars(model) and not getattr(model, "prefixlab_patched", False)
    store = PrefixStore(model, capacity="1MB")
    with pytest.raises(InvalidInputError, match="pickled"):  # (torch.save(model) pickles it)
        pickle.dumps(model)
    store.close()
    pickle.dumps(model)
