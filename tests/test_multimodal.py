"""Multimodal prompts: placeholder tokens whose KV depends on the image, not only on their ids. Reuse and admission
stop at the first placeholder; every request is checked against the same model without prefixlab."""

import pytest
import torch
import transformers as tf
from hf_models import config as text_config
from multimodal_helpers import (
    END,
    GRID,
    GRID_4,
    IMAGE,
    START,
    TEXT,
    VIDEO,
    assert_same,
    build_model,
    image_inputs,
    pixels,
)

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.multimodal import placeholder_token_ids, reusable_columns
from prefixlab.errors import InvalidInputError


@pytest.fixture(scope="module")
def model():
    return build_model()


def generate(model, ids, image=None, cache=None):
    extra = {} if image is None else {"pixel_values": pixels(image), "image_grid_thw": GRID}
    if cache is not None:
        extra["past_key_values"] = cache
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, **extra)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("patch", [True, False])
def test_the_same_image_is_reused_past_it_and_another_image_never(model, patch):
    """Before keys: the second image's request reused the first's placeholder KV, and generate failed ("Image
    features and image tokens do not match"); with the same ids and no pixel check the outputs would have been the
    first image's. Then reuse stopped at the first placeholder. Now both images, the same image again, and a text
    prompt spelling the placeholder ids are exact, and an image seen before is reused past it."""
    prompt = TEXT + [START, IMAGE, END] + list(range(20, 40))
    image_column = prompt.index(IMAGE)
    store = PrefixStore(model, capacity="64MB", patch=patch)
    repeats = []
    for k, image in enumerate((1, 2, 1, None, 2)):  # None: text only, the placeholder ids as plain tokens
        cache = HybridPrefixCache(store)
        assert_same(generate(model, prompt, image), generate(model, prompt, image, cache))
        if k in (1, 3):  # another image, the bare placeholder ids: never the first image's KV
            assert 0 < cache.reused_tokens <= image_column
        if k in (2, 4):
            repeats.append(cache.reused_tokens)
    # patched layers record states anywhere in the pass; unpatched ones where the plan split the forward
    assert (min(repeats) if patch else max(repeats)) > image_column + 1
    match = store.match(prompt)
    assert match.length <= image_column  # the placeholder ids themselves were never admitted: only keys
    store.release(match)
    store.close()


def test_text_before_a_later_image_is_reused_past_a_shared_prefix(model):
    store = PrefixStore(model, capacity="64MB")
    shared = TEXT + list(range(20, 40))
    for k, image in enumerate((1, 2, 1)):  # the image comes after each prompt's own text
        prompt = shared + [60 + k, 61, START, IMAGE, END, 50]
        cache = HybridPrefixCache(store)
        assert_same(generate(model, prompt, image), generate(model, prompt, image, cache))
        assert (cache.reused_tokens > 0) == (k > 0)
    store.close()


def test_placeholders_are_read_from_the_config_and_unknown_ones_stop_all_reuse(model):
    assert placeholder_token_ids(model.config) == [IMAGE, VIDEO, START, END]
    assert placeholder_token_ids(tf.LlavaConfig()) == [32000]
    assert placeholder_token_ids(text_config("qwen3_5")) == []
    ids = torch.tensor([[5, 6, START, IMAGE, 7], [5, 6, 7, 8, START]])
    assert reusable_columns(placeholder_token_ids(model.config), {"input_ids": ids}) == 2  # the earliest of any row
    assert reusable_columns([], {"input_ids": ids}) is None  # a text-only model
    assert reusable_columns([], {"input_ids": ids, "pixel_values": pixels(0)}) == 0


def test_a_text_only_prompt_on_the_multimodal_model_reuses_everything(model):
    """generate hands every first forward of this model `mm_encoder_outputs`: an empty dict when there is no image."""
    store = PrefixStore(model, capacity="64MB")
    prompt = TEXT + list(range(20, 40))
    for _ in range(2):
        cache = HybridPrefixCache(store)
        assert_same(generate(model, prompt), generate(model, prompt, cache=cache))
    assert cache.reused_tokens == len(prompt) - 1
    store.close()


def forward_and_decode(model, inputs: dict, cache=None, steps: int = 3) -> torch.Tensor:
    """A caller's own loop: one forward over the prompt, then greedy one-token forwards (no positions given)."""
    out = model(**inputs, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    past = cache if cache is not None else out.past_key_values
    for _ in range(steps):
        out = model(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=past, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


@torch.no_grad()
def test_a_direct_forward_with_an_image_gets_the_models_own_positions(model):
    """Before: with no position_ids the hooks gave every column its index, so the image's tokens and everything after
    them ran at text positions instead of M-RoPE's (logits off by 0.08 on the very first request, nothing reused),
    and the decode steps after were off too. Now the model's own positions are used, and the text before the image
    is reused."""
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    for k, image in enumerate((1, 1, 2)):
        cache = HybridPrefixCache(store)
        served = forward_and_decode(model, image_inputs(prompt, image), cache)
        torch.testing.assert_close(served, forward_and_decode(model, image_inputs(prompt, image)), atol=1e-5, rtol=0)
        if k == 1:  # the same image: past it
            assert cache.reused_tokens > prompt.index(END)
        if k == 2:  # another image: at most the text before it
            assert 0 < cache.reused_tokens <= prompt.index(IMAGE)
    store.close()


def test_generate_reuses_the_text_before_a_multi_token_image(model):
    """Before: generate's M-RoPE positions (offset past the image) made the request look like custom positions, so
    nothing was looked up or admitted."""
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    for k, image in enumerate((1, 2, 1)):
        inputs = image_inputs(prompt, image)
        cache = HybridPrefixCache(store)
        options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                       output_scores=True)
        outputs = [model.generate(**inputs, **options, **extra) for extra in ({}, {"past_key_values": cache})]
        assert_same(*[(out.sequences, torch.stack(out.scores)) for out in outputs])
        if k == 1:  # another image: at most the text before it
            assert 0 < cache.reused_tokens <= prompt.index(IMAGE)
        if k == 2:  # the first image again: past it
            assert cache.reused_tokens > prompt.index(END)
    store.close()


def test_a_random_stream_of_image_requests_is_exact(model):
    """Requests drawn from a few system prompts, images (1 or 4 tokens, one or two a prompt, or none), questions;
    batches of 1-2 left-padded rows; generate or a direct forward; patched and unpatched stores: every output equals
    the model's own, and later repeats of an image reuse past it."""
    draw = torch.Generator().manual_seed(7)

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=draw))

    systems = [list(range(5, 5 + n)) for n in (6, 9)]
    sizes = {1: torch.tensor([1, 2, 2]), 4: torch.tensor([1, 4, 4])}  # placeholder tokens -> grid (t, h, w)
    pool = [(size, seed) for size in (1, 4) for seed in (1, 2)]  # (placeholder tokens, pixels' seed)

    def row() -> tuple[list[int], list[tuple[int, int]]]:
        ids, images = list(systems[pick(2)]), [pool[pick(4)] for _ in range(pick(3))]
        for size, _ in images:
            ids += [START] + [IMAGE] * size + [END] + [30 + pick(3)]
        return ids + [40 + pick(20) for _ in range(1 + pick(4))], images

    reused_past_an_image = 0
    for patch in (True, False):
        store = PrefixStore(model, capacity="64MB", patch=patch)
        for _ in range(14):
            rows = [row() for _ in range(1 + (pick(3) == 0))]
            width = max(len(ids) for ids, _ in rows)
            pads = torch.tensor([width - len(ids) for ids, _ in rows])
            ids = torch.tensor([[0] * int(pad) + r for pad, (r, _) in zip(pads, rows, strict=True)])
            inputs = {"input_ids": ids, "attention_mask": (torch.arange(width)[None] >= pads[:, None]).long()}
            images = [image for _, row_images in rows for image in row_images]
            if images:
                inputs |= {"pixel_values": torch.cat([torch.randn(size * 4, 3 * 2 * 14 * 14, generator=torch.Generator()
                                                                  .manual_seed(seed)) for size, seed in images]),
                           "image_grid_thw": torch.stack([sizes[size] for size, _ in images]),
                           "mm_token_type_ids": (ids == IMAGE).int()}
            cache = HybridPrefixCache(store)
            if pick(2):
                options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                               output_scores=True)
                outputs = [model.generate(**inputs, **options, **extra) for extra in ({}, {"past_key_values": cache})]
                assert_same(*[(out.sequences, torch.stack(out.scores)) for out in outputs])
            else:
                with torch.no_grad():
                    reference, served = (model(**inputs, **extra).logits[:, -1]
                                         for extra in ({}, {"past_key_values": cache}))
                torch.testing.assert_close(served, reference, atol=1e-5, rtol=0)
            reused_past_an_image += sum(reused > r.index(IMAGE) for (r, row_images), reused
                                        in zip(rows, cache.rows_reused, strict=True) if row_images)
        store.close()
    assert reused_past_an_image >= 2


@torch.no_grad()
def test_videos_are_keyed_like_images(model):
    """A prompt with an image and a video (two temporal patches of 2 x 4: per frame, its delimiters and two
    placeholders): the same image and video again are reused past both, another video never past its first token.
    Before: a direct forward with both failed (the image encoded for its key, the video left raw: "You cannot specify
    both pixel_values/pixel_values_videos and mm_encoder_outputs"), and then reuse stopped at the video."""
    frames = [START, VIDEO, VIDEO, END, START, VIDEO, VIDEO, END]
    for video_first in (False, True):
        parts = [frames, [START] + [IMAGE] * 4 + [END]][:: 1 if video_first else -1]
        ids = torch.tensor([TEXT + parts[0] + [50, 51] + parts[1] + list(range(20, 26))])
        store = PrefixStore(model, capacity="64MB")
        for k, video in enumerate((1, 1, 2)):
            inputs = {"input_ids": ids, "image_grid_thw": GRID_4, "video_grid_thw": torch.tensor([[2, 2, 4]]),
                      "pixel_values": torch.randn(16, 1176, generator=torch.Generator().manual_seed(1)),
                      "pixel_values_videos": torch.randn(16, 1176, generator=torch.Generator().manual_seed(9 + video)),
                      "mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == VIDEO).int()}
            cache = HybridPrefixCache(store)
            served = model(**inputs, past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(served, model(**inputs).logits[:, -1], atol=1e-5, rtol=0)
            last_placeholder = max(i for i, t in enumerate(ids[0].tolist()) if t in (IMAGE, VIDEO))
            if k == 1:
                assert cache.reused_tokens > last_placeholder
            if k == 2:
                assert cache.reused_tokens <= ids[0].tolist().index(VIDEO)
        store.close()


@pytest.mark.parametrize("chunk", [3, 5])
def test_a_chunked_prefill_reuses_an_image_seen_before(model, chunk):
    """generate(prefill_chunk_size=...) hands each chunk the features of its own placeholders: every chunk's image
    tokens are keyed (each token by its own feature row and position), so the same image is reused past it whatever
    the chunking, and another image is not."""
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                   prefill_chunk_size=chunk)
    for k, image in enumerate((1, 2, 1, 1)):  # (a chunked request stores no state at its prompt's end: its repeat does)
        cache = HybridPrefixCache(store)
        outputs = [model.generate(**image_inputs(prompt, image), **options, **extra)
                   for extra in ({}, {"past_key_values": cache})]
        assert_same(*[(out.sequences, torch.stack(out.scores)) for out in outputs])
        if k == 1:
            assert cache.reused_tokens <= prompt.index(IMAGE)
        if k == 3:
            assert cache.reused_tokens > prompt.index(END)
    store.close()


@torch.no_grad()
def test_images_that_do_not_fit_their_placeholders_get_a_clear_error_and_leave_the_store(model):
    """Before: a bare RuntimeError from inside M-RoPE's position code ("The expanded size of the tensor (13) must
    match ..."). Now an InvalidInputError saying what to pass; nothing is looked up or admitted."""
    from prefixlab.errors import InvalidInputError

    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    model(**image_inputs(prompt, 1), past_key_values=HybridPrefixCache(store))
    store.flush()
    before = store.stats()
    bad = [image_inputs(TEXT + [START] + [IMAGE] * 3 + [END], 1),  # one placeholder short of the image's 4
           image_inputs(prompt, 1) | {"image_grid_thw": torch.tensor([[1, 2, 2]])}]  # a grid that is not the image's
    for inputs in bad:
        with pytest.raises(InvalidInputError, match="processor returns them"):
            model(**inputs, past_key_values=HybridPrefixCache(store))
    assert store.stats() == before
    cache = HybridPrefixCache(store)
    model(**image_inputs(prompt, 1), past_key_values=cache)
    assert cache.reused_tokens > prompt.index(END)
    store.close()


def test_a_second_generate_call_continues_a_request_past_an_image(model):
    """A chat turn continued on the same cache: generate's later call gives text positions plus the image's M-RoPE
    offset ([1, batch, t]). Before: refused ("this forward does not continue them") whenever the prompt held an
    image. Now both turns equal the model's own over a DynamicCache, and the second resumes from the store."""
    from transformers import DynamicCache

    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    store = PrefixStore(model, capacity="64MB")
    for _ in range(2):
        turns = []
        for cache in (DynamicCache(config=model.config), HybridPrefixCache(store)):
            first = model.generate(**image_inputs(prompt, 1), **options, past_key_values=cache)
            ids = torch.cat([first.sequences, torch.tensor([[50, 51, 52]])], dim=1)
            second = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options,
                                    past_key_values=cache)
            turns.append([(out.sequences, torch.stack(out.scores)) for out in (first, second)])
        for reference, served in zip(*turns, strict=True):
            assert_same(reference, served)
    assert cache.reused_tokens > len(prompt)
    store.close()


def _generate_4(model, inputs, cache=None, **options):
    extra = {} if cache is None else {"past_key_values": cache}
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         output_scores=True, **extra, **options)
    return out.sequences, torch.stack(out.scores)


def test_generate_without_cache_use_over_an_image_is_exact(model):
    """generate(use_cache=False) feeds the whole sequence every step; the held image columns are keys by content, so
    the tokens fed again never matched them and the step was refused ("does not continue them")."""
    store = PrefixStore(model, capacity="64MB")
    inputs = image_inputs(TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30)), seed=1)
    for _ in range(2):  # the second reuses the first's image
        assert_same(_generate_4(model, inputs, use_cache=False),
                    _generate_4(model, inputs, HybridPrefixCache(store), use_cache=False))
    store.close()


@pytest.mark.parametrize("placeholders", [3, 5])
def test_placeholders_that_do_not_fit_the_image_are_refused_after_a_hit(model, placeholders):
    """With the text before the image cached, the forward after the hit carried only its own placeholders' feature
    rows: the model's mismatch error vanished (3 placeholders for a 4-token image: one feature row dropped, outputs
    returned and admitted) or became an IndexError (5)."""
    store = PrefixStore(model, capacity="64MB")
    tail = [END] + list(range(20, 26))
    _generate_4(model, image_inputs(TEXT + [START] + [IMAGE] * 4 + tail, seed=1), HybridPrefixCache(store))
    store.flush()
    before = store.core.used_bytes, store.stats()["sequences"]
    bad = image_inputs(TEXT + [START] + [IMAGE] * placeholders + tail, seed=1)
    bad.pop("mm_token_type_ids")  # (generate accepts it then; the model refuses it in its forward)
    with pytest.raises(InvalidInputError, match=f"4 feature rows for {placeholders} image placeholder"):
        _generate_4(model, bad, HybridPrefixCache(store))
    store.flush()
    assert (store.core.used_bytes, store.stats()["sequences"]) == before
    store.close()


def test_caller_positions_that_move_the_text_after_an_image_are_not_reused_past_it(model):
    """A direct forward whose M-RoPE positions put the text after the image elsewhere reused that text's KV from a
    request at the model's own positions (23 of 24 tokens, logits off by 8e-3): the keys cover an image's own
    positions only. Such a forward now reuses only what comes before the image."""
    store = PrefixStore(model, capacity="64MB")
    ids = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    inputs = image_inputs(ids, seed=1)
    with torch.no_grad():
        own, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=GRID_4)
        shifted = own.clone()
        shifted[:, :, ids.index(END):] += 7
        for positions, most in ((own, 0), (own, len(ids) - 1), (shifted, ids.index(IMAGE))):
            cache = HybridPrefixCache(store)
            expected = model(**inputs, position_ids=positions).logits[:, -1]
            served = model(**inputs, position_ids=positions, past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(served, expected, atol=1e-5, rtol=0)
            assert cache.reused_tokens <= most and (most == 0 or cache.reused_tokens > 0)
            store.flush()
    store.close()


@torch.no_grad()
def test_an_image_fed_as_a_one_token_forward_is_never_reused_for_another_image(model):
    """Direct forwards feeding a prompt in pieces, its one-token image (with its pixels) alone: the hooks key or limit
    only forwards of several tokens, so the raw placeholder id was recorded and admitted with the first image's KV,
    and the same pieces with another image reused it past the placeholder (20 tokens; last logits off by 0.03). Now
    a one-token forward with media inputs limits what is admitted to the columns before its placeholder."""
    prompt = TEXT + [START, IMAGE, END] + list(range(20, 30))
    ids, column = torch.tensor([prompt]), prompt.index(IMAGE)

    def pieces(image, cache):
        logits = []
        for start, stop in ((0, column), (column, column + 1), (column + 1, len(prompt))):
            extra = {"pixel_values": pixels(image), "image_grid_thw": GRID} if start == column else {}
            logits.append(model(input_ids=ids[:, start:stop], mm_token_type_ids=(ids[:, start:stop] == IMAGE).int(),
                                past_key_values=cache, **extra).logits[:, -1])
        return logits[-1]

    store = PrefixStore(model, capacity="64MB")
    for image in (1, 1, 2):
        reference = model(input_ids=ids, pixel_values=pixels(image), image_grid_thw=GRID,
                          mm_token_type_ids=(ids == IMAGE).int()).logits[:, -1]
        cache = HybridPrefixCache(store)
        torch.testing.assert_close(pieces(image, cache), reference, atol=1e-5, rtol=0)
    match = store.match(prompt)
    assert match.length <= column  # the placeholder id itself was never admitted
    store.release(match)
    store.close()


def test_a_new_prompt_with_text_where_a_used_cache_holds_an_image_is_refused(model):
    """generate() over a used cache checks that the input starts with the tokens it holds; a held image's content
    keys matched any token, so a new prompt spelling text in the image's columns passed, and generate ran its tail on
    the old image's KV. A key now stands only for a placeholder id in the input."""
    prompt = TEXT + [START] + [IMAGE] * 4 + [END] + list(range(20, 30))
    store = PrefixStore(model, capacity="64MB")
    cache = HybridPrefixCache(store)
    first = model.generate(**image_inputs(prompt, 1), max_new_tokens=3, do_sample=False, pad_token_id=0,
                           past_key_values=cache)
    other = first.clone()
    other[0, prompt.index(IMAGE): prompt.index(END)] = torch.tensor([40, 41, 42, 43])  # text in the image's columns
    other = torch.cat([other, torch.tensor([[50, 51]])], dim=1)
    with pytest.raises(InvalidInputError, match="per request"):
        model.generate(input_ids=other, max_new_tokens=3, do_sample=False, pad_token_id=0, past_key_values=cache)
    store.close()
