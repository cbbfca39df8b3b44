"""Sibling batching (prefixlab.fleet.siblings): the grouping of a radix schedule, and one Hydragen batch per group
giving each prompt the uncached model's greedy tokens (attention-only: ragged lengths; hybrids: equal lengths)."""


import hf_models
import numpy as np
import pytest
import recurrent_patch_models
import torch
from hf_models import build
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.attention import HydragenCache
from prefixlab.cache.store import PrefixStore
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import serve, siblings
from prefixlab.fleet.prompts import Prompt
from prefixlab.fleet.schedule import common_prefix, radix_schedule

PREFIX = 40


@st.composite
def prompt_sets(draw):
    """Prompts over a few shared prefixes (some nested), random suffix lengths, a few exact duplicates."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    roots = [rng.integers(3, 9, draw(st.integers(1, 50))) for _ in range(draw(st.integers(1, 3)))]
    prompts = []
    for _ in range(draw(st.integers(1, 14))):
        base = roots[rng.integers(len(roots))]
        prompts.append(np.concatenate([base, rng.integers(3, 9, draw(st.integers(0, 40)))]))
        if not len(prompts[-1]):
            prompts[-1] = np.array([5])
    return prompts + [prompts[0]] * draw(st.integers(0, 2))


@settings(max_examples=60, deadline=None)
@given(prompts=prompt_sets(), mode=st.sampled_from(["ragged", "equal"]), max_batch=st.integers(2, 5))
def test_groups_cover_every_prompt_once_under_its_prime(prompts, mode, max_batch):
    steps = radix_schedule(prompts, min_prefix_tokens=4)
    grouped = siblings.group_siblings(prompts, steps, mode, max_batch=max_batch)
    assert [s for s in grouped if not isinstance(s[0], tuple) and s[1]] == [s for s in steps if s[1]]  # primes kept
    served = []
    primed = set()
    for index, length in grouped:
        if not isinstance(index, tuple):
            if length:
                primed.add(tuple(prompts[index][:length].tolist()))
            else:
                served.append(index)
            continue
        served.extend(index)
        assert 2 <= len(index) <= max_batch
        assert tuple(prompts[index[0]][:length].tolist()) in primed  # its prime ran before it
        assert all(len(prompts[i]) > length and common_prefix(prompts[i], prompts[index[0]]) >= length
                   for i in index)
        if mode == "equal":
            assert len({len(prompts[i]) for i in index}) == 1
    assert sorted(served) == list(range(len(prompts)))


def test_keep_row_cuts_like_generate_alone():
    assert siblings.keep_row([5, 6, 7, 8], 3, {2}) == [5, 6, 7]
    assert siblings.keep_row([5, 2, 7, 8], 3, {2}) == [5, 2]
    assert siblings.keep_row([5, 6, 2, 8], 2, {2}) == [5, 6]


def _served(family, lengths, max_new_tokens):
    """(group result, uncached outputs, store bytes before, after) for rows of PREFIX shared + `lengths` tokens."""
    model = build(family)
    model.set_attn_implementation("hydragen")  # no HydragenCache: SDPA bit for bit, so the reference is the same
    rng = np.random.default_rng(len(lengths))
    prefix = rng.integers(3, 128, PREFIX)
    rows = [np.concatenate([prefix, rng.integers(3, 128, n)]) for n in lengths]
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.inference_mode():
            serve.prime(model, store, prefix)
            before = store.core.used_bytes, store.stats()["sequences"]
            result = siblings.generate_group(model, store, rows, PREFIX, max_new_tokens)
            reference = [serve.generate_uncached(model, r, n) for r, n in zip(rows, max_new_tokens, strict=True)]
            store.core.check_invariants()
            return model, result, reference, before, (store.core.used_bytes, store.stats()["sequences"])
    finally:
        store.close()


def test_attention_only_siblings_of_different_lengths_batch_exactly():
    model, result, reference, before, after = _served("llama", [5, 9, 1, 9], [4, 6, 2, 5])
    assert siblings.batching_mode(model) == "ragged"
    assert result.outputs == reference
    assert result.reused_tokens == PREFIX and result.padding_tokens == (4 + 0 + 8 + 0)
    assert after == before  # the batch is not admitted: the prime's checkpoint is all the store holds
    # 5 decode steps, each reading the shared prefix once and 4 suffixes of (9 + step) tokens
    per_token = siblings.kv_bytes_per_token(model)
    assert result.kv_bytes_read == sum(PREFIX + 4 * (9 + t) for t in range(1, 6)) * per_token
    assert result.kv_bytes_read < sum(serve.decode_kv_bytes(model, PREFIX + n, 6) for n in (5, 9, 1, 9))
    assert result.kv_bytes_held == (PREFIX + 4 * (9 + 5)) * per_token  # the prefix once, 4 padded suffixes


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "lfm2"])  # (LFM2: conv states only)
def test_hybrid_siblings_prefill_alone_and_decode_as_one_batch(family):
    model, result, reference, before, after = _served(family, [7, 1, 12], [4, 6, 2])
    assert siblings.batching_mode(model) == "rows"
    assert result.outputs == reference and result.reused_tokens == PREFIX and result.padding_tokens == 0
    assert after == before
    _, equal, reference, _, _ = _served(family, [7, 7], [3, 5])
    assert equal.outputs == reference and equal.padding_tokens == 0


def test_other_layer_kinds_batch_equal_lengths_only():
    model, result, reference, before, after = _served("nemotron_h", [6, 6, 6], [4, 6, 2])
    assert siblings.batching_mode(model) == "equal"
    assert result.outputs == reference and after == before
    store = PrefixStore(model, capacity="8MB")
    rows = [np.arange(3, 3 + PREFIX + n) for n in (3, 5)]
    try:
        with pytest.raises(InvalidInputError, match="equal lengths only"):
            siblings.generate_group(model, store, rows, PREFIX, [2, 2])
        with pytest.raises(InvalidInputError, match="same 40 tokens"):
            siblings.generate_group(model, store, [rows[0], rows[0][::-1].copy()], PREFIX, [2, 2])
        assert store.core.used_bytes == 0
    finally:
        store.close()


def test_a_ragged_hybrid_group_without_its_prefix_in_the_store_is_left_to_the_plain_path():
    model = build("qwen3_5")
    model.set_attn_implementation("hydragen")
    store = PrefixStore(model, capacity="8MB")
    try:
        with torch.inference_mode():
            rows = [np.arange(3, 3 + PREFIX + n) for n in (3, 5)]
            assert siblings.generate_group(model, store, rows, PREFIX, [2, 2]) is None
        assert store.core.used_bytes == 0 and store.stats()["locked_matches"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_a_model_without_shared_attention_is_not_batched(family):
    assert siblings.batching_mode(build(family)) is None


def test_join_rows_refuses_rows_that_do_not_share_their_levels():
    model = build("llama")
    model.set_attn_implementation("hydragen")
    level = {i: torch.zeros(1, 2, 4, 16) for i in range(2)}
    loaded = []
    for keys in (level, {i: t.clone() for i, t in level.items()}):
        cache = HydragenCache(model.config)
        cache.load_shared_prefix(keys, keys, batch_size=1)
        loaded.append(cache)
    with pytest.raises(InvalidInputError, match="same loaded levels"):
        HydragenCache.join_rows(model.config, loaded)
    wide = HydragenCache(model.config)
    wide.load_shared_prefix(level, level, batch_size=2)
    with pytest.raises(InvalidInputError, match="batch-1"):
        HydragenCache.join_rows(model.config, [loaded[0], wide])
    with pytest.raises(InvalidInputError, match="batch-1"):
        HydragenCache.join_rows(model.config, [])


def test_serve_falls_back_to_one_by_one_where_the_cache_cannot_load_the_model(capsys, monkeypatch):
    """A group whose shared prefix HydragenCache cannot load raises before any output, and every prompt is served
    one by one, exactly (as LFM2's conv-only states did before load_shared_prefix took them)."""
    from prefixlab.errors import UnsupportedModelError

    def refuse(*args, **kwargs):
        raise UnsupportedModelError("cannot load this model's states")

    monkeypatch.setattr(HydragenCache, "load_shared_prefix", refuse)
    model = build("qwen3_5")
    model.set_attn_implementation("hydragen")
    assert siblings.batching_mode(model) == "rows"
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 128, PREFIX)
    prompts = [Prompt(k, k, np.concatenate([prefix, rng.integers(3, 128, 2 + k)]), 3) for k in range(3)]
    steps = siblings.group_siblings([p.tokens for p in prompts], radix_schedule([p.tokens for p in prompts]), "rows")
    assert any(isinstance(index, tuple) for index, _ in steps)
    records, store = [], PrefixStore(model, capacity="64MB")
    try:
        stats = serve.serve(model, store, prompts, steps, records.append)
    finally:
        store.close()
    assert "serving prompts one by one" in capsys.readouterr().err and stats.batches == 0
    with torch.inference_mode():
        assert {r["id"]: r["output_ids"] for r in records} == \
            {p.id: serve.generate_uncached(model, p.tokens, 3) for p in prompts}


@pytest.mark.parametrize("family", ["llama", "falcon_h1", "zamba2", "zamba", "jamba", "mamba2", "falcon_mamba"])
def test_kv_bytes_per_token_is_what_the_store_holds_per_token(family):
    """The decode-KV figures of `prefixlab run` count every attention layer the model has, however its config names
    them (Falcon-H1: attention in every layer; Zamba, Zamba2: shared blocks; Mamba2: none)."""
    model = hf_models.build(family) if family == "llama" else recurrent_patch_models.build(family)
    store = PrefixStore(model, capacity="64MB", policy="sglang+")
    try:
        with torch.inference_mode():
            serve.prime(model, store, np.arange(3, 3 + PREFIX))
        assert siblings.kv_bytes_per_token(model) * PREFIX == store.core.tree.kv_bytes
    finally:
        store.close()


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_serve_runs_a_model_without_attention_exactly(family):
    """Pure Mamba2 / Mamba (no attention layer, nothing to batch): every prompt served one by one, as the uncached
    model."""
    model = recurrent_patch_models.build(family)
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 60, 12)
    prompts = [Prompt(k, k, np.concatenate([prefix, rng.integers(3, 60, 1 + k)]), 3) for k in range(3)]
    records, store = [], PrefixStore(model, capacity="64MB")
    try:
        stats = serve.serve(model, store, prompts, radix_schedule([p.tokens for p in prompts]), records.append)
    finally:
        store.close()
    assert stats.kv_bytes_read == 0 and stats.reused_tokens > 0
    reference = recurrent_patch_models.build(family)
    with torch.inference_mode():
        assert {r["id"]: r["output_ids"] for r in records} == \
            {p.id: serve.generate_uncached(reference, p.tokens, 3) for p in prompts}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "bamba",
                                    "granitemoehybrid", "jamba", "lfm2", "lfm2_moe",
                                    "lfm3"])  # (every family of batching mode "rows")
def test_hybrid_siblings_of_close_lengths_prefill_in_one_right_padded_forward(family, monkeypatch):
    """Rows whose own tokens (8, 7, 9 after the prefix) pad each other little are prefilled together: one forward
    over the batch, right-padded, each row's states captured at its own end by the patched layers; every row's
    greedy tokens are the uncached model's."""
    forwards, forward = [], siblings._forward
    monkeypatch.setattr(siblings, "_forward", lambda model, cache, ids, *args: forwards.append(tuple(ids.shape))
                        or forward(model, cache, ids, *args))
    model, result, reference, before, after = _served(family, [9, 8, 10], [4, 3, 5])
    assert siblings.batching_mode(model) == "rows"
    assert forwards == [(3, 9)]  # (one by one before: (1, 8), (1, 7), (1, 9))
    assert result.outputs == reference and result.reused_tokens == PREFIX
    assert result.padding_tokens == 3 * 9 - (8 + 7 + 9)  # the right pads it computed
    assert after == before


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
@pytest.mark.parametrize("lengths", [(6, 3), (9, 8, 10)])  # prefilled one by one; together
def test_rows_prefilled_alone_get_the_keys_of_their_own_positions(family, lengths):
    """Bamba's forward numbers its input from 0 when given no position_ids, even over a cache: each row's own
    tokens were prefilled at positions 0.. instead of after the shared prefix (other RoPE in their keys, while the
    tiny model's few greedy tokens happened to agree). Their keys now equal the plain model's."""
    from transformers import DynamicCache

    from prefixlab.attention.hf_cache import SharedPrefixLayer

    model = build(family)
    model.set_attn_implementation("hydragen")
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 128, PREFIX)
    rows = [np.concatenate([prefix, rng.integers(3, 128, n)]) for n in lengths]
    store = PrefixStore(model, capacity="64MB")
    try:
        with torch.inference_mode():
            serve.prime(model, store, prefix)
            head = torch.as_tensor(rows[0][:PREFIX + store.min_prefill_tokens])[None]
            joined, _ = siblings._prefill_rows(model, store, head, rows)
            for b, tokens in enumerate(rows):
                plain = DynamicCache(config=model.config)
                model(torch.as_tensor(tokens[:-1])[None], past_key_values=plain, use_cache=True)
                for layer, expected in zip(joined.layers, plain.layers, strict=True):
                    if isinstance(layer, SharedPrefixLayer):
                        own = len(tokens) - 1 - PREFIX
                        torch.testing.assert_close(layer.keys[b, :, layer.keys.shape[2] - own:],
                                                   expected.keys[0, :, PREFIX:], atol=1e-5, rtol=0)
                    else:  # and each row's states are its own tokens', without padding
                        torch.testing.assert_close(layer.conv_states[0][b], expected.conv_states[0][0], atol=1e-5,
                                                   rtol=0)
                        torch.testing.assert_close(layer.recurrent_states[0][b], expected.recurrent_states[0][0],
                                                   atol=1e-5, rtol=0)
    finally:
        store.close()
