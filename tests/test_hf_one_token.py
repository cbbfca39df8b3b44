"""Direct forwards of one token over a HybridPrefixCache (a prompt fed in pieces, a decode loop of one's own): a pad
or a mask they carry is never stored as plain tokens, other rows are refused, and tokens that only look like the
held ones are new tokens."""

import itertools

import pytest
import recurrent_patch_models as rpm
import torch
from hf_models import build, cache_argument

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError


def _later_is_exact(model, reference, store, later):
    cache = HybridPrefixCache(store)
    options = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        got = model.generate(later, **{cache_argument(model): cache}, **options)
        want = reference.generate(later, **options)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=0)
    return cache.reused_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_new_tokens_like_the_held_ones_without_positions_are_new_tokens(family):
    """Without position_ids, [a, b] over a cache holding [a] was taken for the held token fed again: a cut off,
    b run at column 1 (logits 0.1 off)."""
    model = build(family)
    a, b = 17, 42
    with torch.no_grad():
        full = model(input_ids=torch.tensor([[a, a, b]])).logits
        store = PrefixStore(model, capacity="64MB")
        cache = HybridPrefixCache(store)
        model(input_ids=torch.tensor([[a]]), past_key_values=cache)
        out = model(input_ids=torch.tensor([[a, b]]), past_key_values=cache).logits
    torch.testing.assert_close(out, full[:, 1:], atol=1e-5, rtol=0)
    store.close()


@pytest.mark.parametrize("family, pieces", [("qwen3_5_text", [0, 1, 7]), ("qwen3_5_text", [0, 2, 3, 7]),
                                            ("mamba2", [0, 1, 7]), ("mamba", [0, 1, 7])])
def test_a_one_token_forward_at_a_rows_pad_is_not_stored(family, pieces):
    """transformers masks no pad out of a one-token forward: the pad entered the short row's states, the row was
    admitted once a later forward resolved its pads, and a later unpadded request resumed it (up to 2.2 off)."""
    reference, model = rpm.build(family, seed=5), rpm.build(family, seed=5)
    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=1)
    ids = torch.tensor([[0, 0, 0, 0, 12, 58, 9], [10, 23, 39, 14, 60, 7, 8]])  # row 0: 4 left pads
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate gives a left-padded batch
    cache = HybridPrefixCache(store)
    with torch.no_grad():
        for start, stop in itertools.pairwise(pieces):
            extra = {} if family in ("mamba2", "mamba") else {"position_ids": positions[:, start:stop]}
            model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], **{cache_argument(model): cache},
                  **extra)
    assert cache.report().admission.startswith("admitted")  # the row without pads
    assert _later_is_exact(model, reference, store, torch.tensor([[12, 58, 9, 5, 6, 7]])) == 0  # not the padded one
    assert _later_is_exact(model, reference, store, ids[1:, :6]) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prefill_of_one_token_chunks_still_stores_the_rows_without_pads(family):
    """generate(prefill_chunk_size=1) over a left-padded batch feeds the short row's pads one by one: only that
    row may be left out (a first version left the whole request out)."""
    reference, model = build(family), build(family)
    store = PrefixStore(model, capacity="64MB")
    ids = torch.tensor([[0, 0, 12, 58, 9, 33, 21], [10, 23, 39, 14, 60, 7, 8]])
    cache = HybridPrefixCache(store)
    with torch.no_grad():
        served = model.generate(ids, attention_mask=(ids != 0).long(), past_key_values=cache, max_new_tokens=2,
                                do_sample=False, pad_token_id=0, eos_token_id=None, prefill_chunk_size=1)
    assert cache.report().admission.startswith("admitted")
    assert _later_is_exact(model, reference, store, torch.cat([served[1:], torch.tensor([[5, 6]])], dim=1)) >= 7


@pytest.mark.parametrize("hidden", [5, 2])
def test_a_one_token_forward_with_a_mask_of_its_own_is_not_stored(hidden):
    """A one-token forward whose column is masked out (or that hides an earlier column) computes other KV: it was
    admitted as plain tokens (a later request 0.026 off)."""
    reference, model = build("llama", seed=3), build("llama", seed=3)
    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=1)
    ids = torch.tensor([[12, 58, 9, 33, 21, 17, 40]])
    masked = torch.ones(1, 7, dtype=torch.long)
    masked[0, hidden] = 0
    cache = HybridPrefixCache(store)
    with torch.no_grad():
        model(input_ids=ids[:, :5], attention_mask=torch.ones(1, 5, dtype=torch.long), past_key_values=cache)
        model(input_ids=ids[:, 5:6], attention_mask=masked[:, :6], past_key_values=cache)
        model(input_ids=ids[:, 6:7], attention_mask=masked, past_key_values=cache)
    assert cache.report().admission.startswith("not admitted")
    _later_is_exact(model, reference, store, torch.tensor([[12, 58, 9, 33, 21, 17, 40, 5, 6]]))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_one_token_forward_of_other_rows_is_refused_clearly(family):
    model = build(family)
    store = PrefixStore(model, capacity="64MB")
    cache = HybridPrefixCache(store)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), past_key_values=cache)
        with pytest.raises(InvalidInputError, match="holds a request of 2 rows"):
            model(input_ids=torch.tensor([[11]]), past_key_values=cache)
    store.close()
