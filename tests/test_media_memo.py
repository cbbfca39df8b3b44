"""The encoder memo (cache/media_memo.py): a repeated image skips the vision tower, exactly, and only where that is
the same computation (same weights, no autograd, eval mode, the same namespace)."""

import pytest
import torch
from multimodal_helpers import END, IMAGE, START, TEXT, assert_same, build_model, image_inputs

from prefixlab import HybridPrefixCache, PrefixStore


@pytest.fixture(scope="module")
def model():
    return build_model()


def test_a_repeated_image_skips_the_vision_tower(model):
    """The encoder's outputs are kept by their pixels (media_memo.py): a repeated image runs no vision tower, in
    generate and in a direct forward; outputs equal a copy of the model that never carried a store; an image over the
    budget pushes out the least recently used; media_cache=0 keeps none; close() takes the memo off the model."""
    import copy

    clean = copy.deepcopy(model)
    runs = []
    hook = model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    try:
        for media_cache, expected_runs in (("4000B", [1, 0, 1, 1, 0]), (0, [1, 1, 1, 1, 1])):  # one image's 3 kB fit
            store = PrefixStore(model, capacity="64MB", media_cache=media_cache)
            for image, expected in zip((1, 1, 2, 1, 1), expected_runs, strict=True):
                runs.clear()
                served = model.generate(**image_inputs(prompt, image), **options,
                                        past_key_values=HybridPrefixCache(store))
                assert len(runs) == expected
                reference = clean.generate(**image_inputs(prompt, image), **options)
                assert_same((reference.sequences, torch.stack(reference.scores)),
                            (served.sequences, torch.stack(served.scores)))
            runs.clear()
            with torch.no_grad():  # a direct forward encodes through the same memo
                served = model(**image_inputs(prompt, 1), past_key_values=HybridPrefixCache(store)).logits
                torch.testing.assert_close(served[:, -1], clean(**image_inputs(prompt, 1)).logits[:, -1], atol=1e-5,
                                           rtol=0)
            assert len(runs) == (0 if media_cache else 1)
            store.close()
        assert "get_image_features" not in vars(model.model)
    finally:
        hook.remove()


@pytest.mark.parametrize("bad", ["lots", -1, True, 1.5])
def test_a_bad_media_cache_is_refused_before_the_model_is_touched(model, bad):
    from prefixlab.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="media_cache"):
        PrefixStore(model, capacity="64MB", media_cache=bad)
    assert "get_image_features" not in vars(model.model)


@pytest.mark.parametrize("none", ["0", "0MB", "0 GiB"])
def test_a_media_cache_of_zero_written_as_a_size_keeps_none(model, none):
    """media_cache=0 keeps no encoded image; "0MB" was refused ("must be a positive number of bytes")."""
    store = PrefixStore(model, capacity="64MB", media_cache=none)
    assert store.options["media_cache"] == 0
    store.close()


def test_a_training_step_after_a_request_gets_its_own_vision_tower_graph(model):
    """Before: the memo handed a training forward (autograd on, no cache) the features a no_grad request had encoded
    for the same image, so the loss was right but every vision parameter got no gradient (and an output encoded with
    autograd on was kept with its graph). Now calls with autograd on are not memoized."""
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    try:
        model.generate(**image_inputs(prompt, 1), max_new_tokens=2, do_sample=False, pad_token_id=0,
                       past_key_values=HybridPrefixCache(store))
        model(**image_inputs(prompt, 1), labels=torch.tensor([prompt])).loss.backward()
        assert all(p.grad is not None for p in model.model.visual.parameters())
    finally:
        model.zero_grad(set_to_none=True)
        store.close()


def test_one_namespace_never_gets_another_namespaces_encoded_image(model):
    """A skipped vision tower would tell tenant b that tenant a sent this image (the timing side channel namespaces
    close for prefixes): the memo keys by the request's namespace."""
    runs = []
    hook = model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    options = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    store = PrefixStore(model, capacity="64MB")
    try:
        for namespace, expected in (("a", 1), ("a", 0), ("b", 1), ("b", 0)):
            runs.clear()
            model.generate(**image_inputs(prompt, 7), **options, past_key_values=HybridPrefixCache(store, namespace))
            assert (namespace, len(runs)) == (namespace, expected)
    finally:
        hook.remove()
        store.close()


def test_a_model_in_training_mode_encodes_every_image_again(model):
    """Evaluation with dropout on (train mode under no_grad, no cache): each call draws its own dropout sample, so a
    repeated image must not get the memo's features of an earlier call."""
    runs = []
    hook = model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.no_grad():
            model(**image_inputs(prompt, 3))
            model(**image_inputs(prompt, 3))
            assert len(runs) == 1  # eval mode: the memo serves the repeat
            model.train()
            model(**image_inputs(prompt, 3))
            model(**image_inputs(prompt, 3))
            assert len(runs) == 3
    finally:
        model.eval()
        hook.remove()
        store.close()


def test_an_image_encoded_under_autocast_is_not_served_to_a_forward_without_it(model):
    """Before: the memo's key held the pixels and weights but not the precision the vision tower ran in, so an image
    encoded under torch.autocast (a forward the patched layers then refused: the encoder runs first) was kept as bf16
    features and handed to the next forward in float32, whose logits moved by bf16 rounding. Now a call under
    autocast is not memoized, and the matmul precision settings are part of the key."""
    from prefixlab.errors import InvalidInputError

    clean = build_model()
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(InvalidInputError, match="autocast"):
                model(**image_inputs(prompt, 5))
            served = model(**image_inputs(prompt, 5)).logits
            reference = clean(**image_inputs(prompt, 5)).logits
        torch.testing.assert_close(served, reference, atol=1e-5, rtol=0)
    finally:
        store.close()
