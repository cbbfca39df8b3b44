"""What `prefixlab run` decodes with whatever a model's generation config says: options that read each prompt's
tokens are not batched as siblings (prefixlab.fleet.siblings), and fields that would break a cached greedy generate
are overridden."""

import re

import numpy as np
import pytest
import torch
from hf_models import build
from transformers import WatermarkingConfig

import prefixlab.attention  # noqa: F401  (registers attn_implementation="hydragen")
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import generation_options, serve, siblings
from prefixlab.fleet.prompts import Prompt
from prefixlab.fleet.stops import generate_options

PREFIX = 40


def _group_over_a_primed_prefix(configure, seed, check, own=(2, 9)) -> None:
    """`check(model, store, rows)` on a llama (`configure(model)` first) whose store holds a primed PREFIX that rows
    of `own` own tokens (2 and 9) share."""
    model = build("llama")
    configure(model)
    model.set_attn_implementation("hydragen")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 128, PREFIX)
    rows = [np.concatenate([prefix, rng.integers(3, 128, n)]) for n in own]
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.inference_mode():
            serve.prime(model, store, prefix)
            check(model, store, rows)
    finally:
        store.close()


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.3), ("prompt_lookup_num_tokens", 3),
                                          ("assistant_early_exit", 1),
                                          ("watermarking_config", WatermarkingConfig(context_width=3,
                                                                                     seeding_scheme="selfhash"))])
def test_generation_options_that_read_each_prompt_are_not_batched(field, value):
    """repetition_penalty (and the like) counted a padded row's pads as its prompt's tokens: other greedy tokens.
    Prompt lookup / early-exit assisted decoding (what a generation_config.json may ask for) runs one row only:
    `run --hydragen` failed with transformers' ValueError, where the plain run serves the same prompts. A "selfhash"
    watermark hashes a row's last context_width - 1 tokens: pads in a row of few own tokens (6 of 8 seeds' rows of
    one own token got other greedy tokens)."""
    def check(model, store, rows):
        with pytest.raises(InvalidInputError, match=re.escape(f"{field}={value!r}")):
            siblings.generate_group(model, store, rows, PREFIX, [3, 3])

    _group_over_a_primed_prefix(lambda model: setattr(model.generation_config, field, value), 4, check)


@pytest.mark.parametrize("option", ["bad_words_ids", "sequence_bias"])
def test_banned_or_biased_sequences_that_read_a_rows_last_tokens_are_not_batched(option):
    """A multi-token bad word (or biased sequence) is matched against each row's last tokens: in a batch those of a
    row with few own tokens are pads, not its prefix's, so its word went unmatched (row 0 got [25, 89, 26] where
    alone it gets [41, 97, 79]). Single tokens read nothing before them: those still batch, exactly."""
    def configure(word):
        def set_(model):
            if option == "bad_words_ids":
                model.generation_config.bad_words_ids = [word]
            else:
                model.generation_config.sequence_bias = {tuple(word): -100.0}
        return set_

    def refused(model, store, rows):
        with pytest.raises(InvalidInputError, match=option):
            siblings.generate_group(model, store, rows, PREFIX, [3, 3])

    def exact(model, store, rows):
        assert generation_options.prompt_reading_options(model) == []
        expected = [serve.generate_uncached(model, row, 3) for row in rows]
        assert siblings.generate_group(model, store, rows, PREFIX, [3, 3]).outputs == expected

    # (seed 4: the word is row 0's last prefix token, its 2 own tokens, and the token it would generate first)
    _group_over_a_primed_prefix(configure([79, 40, 91, 25]), 4, refused)
    _group_over_a_primed_prefix(configure([25]), 4, exact)


@pytest.mark.parametrize("field, value, pad", [("encoder_repetition_penalty", 1.3, 107),
                                               ("encoder_no_repeat_ngram_size", 1, 41)])
def test_encoder_options_read_a_padded_rows_pads_so_its_siblings_are_served_one_by_one(capsys, field, value, pad):
    """A decoder-only model's "encoder" ids are the prompt as generate gets it, a padded row's pads included:
    encoder_repetition_penalty boosted the pad id and encoder_no_repeat_ngram_size banned it (or its n-grams) in a
    batch only. With the pad id 107 (41) row 0 got [25, 107, 42] ([89, 26, 72]) where alone it gets [25, 89, 26]
    ([41, 97, 110]). Such siblings are now served one by one, as the plain run serves them."""
    def check(model, store, rows):
        model.config.pad_token_id = pad
        prompts = [Prompt(k, k, row, 3) for k, row in enumerate(rows)]
        records = []
        serve.serve(model, store, prompts, [((0, 1), PREFIX)], records.append)
        assert {r["id"]: r["output_ids"] for r in records} == \
            {p.id: serve.generate_uncached(model, p.tokens, 3) for p in prompts}
        assert f"{field}={value!r}" in capsys.readouterr().err

    _group_over_a_primed_prefix(lambda model: setattr(model.generation_config, field, value), 4, check)


def test_a_batch_that_would_move_a_dynamic_rope_is_served_one_by_one():
    """A dynamic RoPE rescales its frequencies for the whole batch once the longest row passes the context: a row
    decoding past it (the batch runs max(max_new_tokens) steps) changed the other rows' tokens."""
    def check(model, store, rows):
        limit = model.config.max_position_embeddings
        assert siblings.generate_group(model, store, rows, PREFIX, [2, limit - len(rows[0])]) is None
        assert siblings.generate_group(model, store, rows, PREFIX, [2, 3]) is not None  # (within the context)

    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    _group_over_a_primed_prefix(lambda model: setattr(model.config, "rope_parameters", dynamic), 5, check)


def test_a_prime_the_store_already_resumes_is_skipped():
    """A prime at the depth an earlier prompt left cached recomputed its last token (the planner's work predicted
    none)."""
    model = build("llama")
    rng = np.random.default_rng(6)
    first = rng.integers(3, 128, PREFIX)
    prompts = [Prompt(0, 0, first, 2), Prompt(1, 1, np.concatenate([first, [5]]), 2),
               Prompt(2, 2, np.concatenate([first, [6]]), 2)]
    store = PrefixStore(model, capacity="64MB")
    try:
        stats = serve.serve(model, store, prompts, [(0, 0), (1, PREFIX), (1, 0), (2, 0)], lambda record: None)
    finally:
        store.close()
    assert stats.prime_tokens == 0 and stats.prefilled_tokens == PREFIX + 1 + 1


def test_a_generation_config_asking_for_beams_is_still_served_greedily():
    """A model folder whose generation_config.json sets num_beams was served with beam search (the README says
    `prefixlab run` decodes greedily)."""
    model = build("llama")
    rng = np.random.default_rng(6)
    tokens = rng.integers(3, 60, 12)
    greedy = model.generate(torch.as_tensor(tokens)[None], max_new_tokens=5, do_sample=False, num_beams=1,
                            pad_token_id=0)[0, 12:].tolist()
    model.generation_config.num_beams, model.generation_config.num_return_sequences = 3, 2
    assert serve.generate_uncached(model, tokens, 5) == greedy


@pytest.mark.parametrize("field, value", [("cache_implementation", "static"), ("return_dict_in_generate", True)])
def test_generation_config_fields_that_break_a_cached_generate_are_overridden(field, value):
    """A model folder whose generation_config.json sets cache_implementation ("static", as saved for torch.compile)
    failed every prompt of `prefixlab run`: generate refuses a cache passed beside one (a ValueError traceback);
    return_dict_in_generate made generate return an output object: "TypeError: tuple indices must be integers"."""
    model = build("qwen3_5")
    tokens = np.random.default_rng(7).integers(3, 60, 12)
    own = model.generate(torch.as_tensor(tokens)[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
    setattr(model.generation_config, field, value)
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.inference_mode():
            assert serve.generate_uncached(model, tokens, 5) == own[0, 12:].tolist()
            served = [serve.generate(model, store, tokens, 5) for _ in range(2)]  # (the second reuses the first)
    finally:
        store.close()
    assert [s[0] for s in served] == [own[0, 12:].tolist()] * 2 and served[1][1] == 11

    def check(model, store, rows):  # a Hydragen batch of siblings too
        result = siblings.generate_group(model, store, rows, PREFIX, [3, 3])
        assert result.outputs == [serve.generate_uncached(model, row, 3) for row in rows]

    _group_over_a_primed_prefix(lambda model: setattr(model.generation_config, field, value), 8, check)


@pytest.mark.parametrize("field", ["min_new_tokens", "bad_words_ids"])
def test_options_reading_the_eos_list_keep_rows_with_stop_ids_out_of_a_batch(capsys, field):
    """A prompt's stop_token_ids join generate's EOS list when it is served alone (fleet/stops.generate_options), which
    min_new_tokens suppresses for the first tokens and from which bad_words_ids lifts a one-token ban; in a sibling
    batch they were a stopping criterion only: the rows stopped at their 1st / 2nd token (min_new_tokens=3), or never
    got their stop id (banned), where alone they get other tokens."""
    def check(model, store, rows):
        greedy = [serve.generate_uncached(model, row, 6) for row in rows]
        stops = [(greedy[0][0],), (greedy[1][1],)]
        setattr(model.generation_config, field, 3 if field == "min_new_tokens" else [list(ids) for ids in stops])
        expected = [serve.generate_uncached(model, row, 6, stops=generate_options(model, ids))
                    for row, ids in zip(rows, stops, strict=True)]
        with pytest.raises(InvalidInputError, match=field):
            siblings.generate_group(model, store, rows, PREFIX, [6, 6], 0, stops)
        prompts = [Prompt(k, k, row, 6, stop_token_ids=stops[k]) for k, row in enumerate(rows)]
        records = []
        serve.serve(model, store, prompts, [((0, 1), PREFIX)], records.append)
        assert [r["output_ids"] for r in sorted(records, key=lambda r: r["id"])] == expected
        assert "serving prompts one by one" not in capsys.readouterr().err  # (only such rows leave the batch)

    _group_over_a_primed_prefix(lambda model: None, 3, check, own=(5, 9))


def test_a_watermark_skipping_rows_shorter_than_its_context_is_not_batched():
    """transformers' watermark adds no bias while the input is shorter than context_width: a "lefthash" one (which
    hashes the last token only) did bias a 3-token row in a batch 8 columns wide, where alone it does not (row 0 got
    [41, 124, 118, 35] where alone it gets [41, 124, 119, 78])."""
    model = build("llama")
    model.generation_config.watermarking_config = WatermarkingConfig(context_width=6, seeding_scheme="lefthash",
                                                                     bias=5.0)
    model.set_attn_implementation("hydragen")
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 128, 2)
    rows = [np.concatenate([prefix, rng.integers(3, 128, n)]) for n in (1, 6)]
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.inference_mode():
            serve.prime(model, store, prefix)
            with pytest.raises(InvalidInputError, match="watermarking_config"):
                siblings.generate_group(model, store, rows, 2, [4, 4])
    finally:
        store.close()
    model.generation_config.watermarking_config = WatermarkingConfig(context_width=1, seeding_scheme="lefthash")
    assert generation_options.prompt_reading_options(model) == []  # (the last token alone: it batches)
