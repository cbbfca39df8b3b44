"""Forwards that continue a started HybridPrefixCache other than plainly, and left pads that change states."""

import pytest
import torch
from hf_models import _COMMON, FAMILIES, build, cache_argument

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError


def tokens(*shape, seed=0):
    return torch.randint(3, 120, shape, generator=torch.Generator().manual_seed(seed))


def generate(model, input_ids, cache=None, **kwargs):
    extra = {} if cache is None else {cache_argument(model): cache}
    return model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra, **kwargs)


def logits_over_store(model, store, ids):
    """(reused tokens, max |logits - the uncached model's|) of a plain request for `ids` over `store`."""
    cache = HybridPrefixCache(store)
    with torch.no_grad():
        got = model(input_ids=ids, **{cache_argument(model): cache}).logits
        want = model(input_ids=ids).logits[:, cache.reused_tokens:]
    return cache.reused_tokens, float((got - want).abs().max())


@pytest.mark.parametrize("how", ["chunked", "turn"])
def test_positions_restarting_inside_a_later_forward_are_not_stored(how):
    """Only a continuing forward's first column was checked: tokens run at restarted positions (packed documents)
    in a later prefill chunk or chat turn were stored as if at plain positions; a later plain request reused them
    (logits 1e-2 off, other greedy tokens)."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    first = tokens(1, 16, seed=1)
    if how == "chunked":
        ids = torch.cat([first, tokens(1, 8, seed=2)], 1)
        positions = torch.cat([torch.arange(20), torch.arange(4)])[None]
        options = {"prefill_chunk_size": 8, "past_key_values": HybridPrefixCache(store)}
    else:
        cache = HybridPrefixCache(store)
        ids = torch.cat([generate(model, first, cache), tokens(1, 8, seed=2)], 1)  # turn 1: 20 tokens
        positions = torch.cat([torch.arange(24), torch.arange(4)])[None]
        options = {"past_key_values": cache}
    run = {"position_ids": positions, "max_new_tokens": 1, "do_sample": False, "pad_token_id": 0}
    out = model.generate(ids, **run, **options)
    assert torch.equal(out, model.generate(ids, **run, prefill_chunk_size=options.get("prefill_chunk_size")))
    reused, diff = logits_over_store(model, store, torch.cat([out, tokens(1, 3, seed=3)], 1))
    assert diff <= 1e-5 and reused == (19 if how == "turn" else 0)  # (turn 1, plain, is kept)


def test_a_later_call_with_more_rows_is_refused_clearly_and_keeps_the_earlier_request():
    """generate repeats the input's rows for num_beams, not a used cache's: a raw torch size error; and that failure
    dropped the earlier, finished request before it was admitted."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    cache = HybridPrefixCache(store)
    first = generate(model, tokens(1, 16, seed=5), cache)
    with pytest.raises(InvalidInputError, match="holds a request of 1 rows and this forward has 3"):
        generate(model, torch.cat([first, tokens(1, 3, seed=6)], 1), cache, num_beams=3)
    reused, diff = logits_over_store(model, store, torch.cat([first, tokens(1, 2, seed=7)], 1))
    assert reused == first.shape[1] - 1 and diff <= 1e-5


@pytest.mark.parametrize("family, option", [("bamba", {"mamba_proj_bias": True}), ("lfm2", {"conv_bias": True}),
                                            ("mamba", {"use_bias": True}),
                                            ("zaya", {"attention_bias": True}),  # (ZAYA: q / k feed its CCA conv)
                                            ("inkling", {"log_scaling_n_floor": 2})])
def test_left_pads_that_change_states_are_neither_stored_nor_resumed(family, option):
    """With a bias in a recurrent layer's input projection a left pad is not zero there: it enters the row's conv
    window and states. A padded row's states were stored as the row's alone (a later unpadded request 4e-3 off) and
    padded rows resumed the row's own states (5e-3 off the uncached batch). Inkling's log-scaled attention counts
    positions by cache columns, pads included: a padded row's tokens sit at other positions."""
    config_class, model_class, overrides = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**(_COMMON | overrides | option))).eval()
    with torch.no_grad():  # (random init zeroes biases; a trained model's are not)
        for name, param in model.named_parameters():
            if name.endswith(("in_proj.bias", "q_proj.bias", "k_proj.bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=4)
    assert store.pads_change_states
    short, long = tokens(24, seed=7), tokens(36, seed=8)
    batch, mask = torch.zeros(2, 36, dtype=torch.long), torch.zeros(2, 36, dtype=torch.long)
    batch[0, 12:], mask[0, 12:], batch[1], mask[1] = short, 1, long, 1
    generate(model, short[None], HybridPrefixCache(store))  # the short row alone, unpadded: stored
    cache = HybridPrefixCache(store)
    out = generate(model, batch, cache, attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    want = generate(model, batch, attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    assert cache.rows_reused == [0, 0] and torch.equal(out.sequences, want.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, want.logits, strict=True)) <= 1e-5
    reused, diff = logits_over_store(model, store, torch.cat([short, tokens(5, seed=9)])[None])
    assert reused == 24 and diff <= 1e-5  # the unpadded row's own entry, not the padded batch's


def test_a_failed_forward_is_reported_as_not_admitted():
    """After a forward raised inside the model, the cache's report still said "pending (admitted on the store's next
    use)"."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    cache = HybridPrefixCache(store)

    def fail(*_):
        raise RuntimeError("a layer failed")

    handle = model.model.layers[1].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="a layer failed"):
            model(input_ids=tokens(1, 12, seed=4), past_key_values=cache)
    finally:
        handle.remove()
    assert cache.report().admission == "not admitted (a forward of the request failed)"
    assert store.stats()["used_bytes"] == 0


def test_a_later_turn_after_the_weights_changed_loads_nothing_of_the_old_weights():
    """A chat turn continued on the same cache after the weights changed loaded a deeper checkpoint of the old
    weights (only a request's first forward checked them): other tokens than a DynamicCache gives."""
    from transformers import DynamicCache

    model = build("qwen3_5")
    old, new = ({k: v.clone() for k, v in build("qwen3_5", seed=s).state_dict().items()} for s in (0, 1))

    def two_turns(cache, store=None):
        model.load_state_dict(old)
        first = generate(model, tokens(1, 20, seed=1), cache)
        turn = torch.cat([first, tokens(1, 15, seed=4)], 1)
        if store is not None:  # the whole conversation stored under the old weights, deeper than the cache holds
            generate(model, turn, HybridPrefixCache(store))
        model.load_state_dict(new)
        return generate(model, turn, cache)

    want = two_turns(DynamicCache(config=model.config))
    store = PrefixStore(model, capacity="64MB")
    with pytest.warns(RuntimeWarning, match="weights changed"):
        assert torch.equal(two_turns(HybridPrefixCache(store), store), want)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_prefill_chunk_starting_at_a_pad_token_runs_as_given(family):
    """A pad token id mid-prompt (generate masks it and counts positions over unmasked tokens) at a chunk's first
    column: that column's position says nothing, and the chunk was refused as a new prompt mid-generate."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi")
    ids = tokens(1, 30, seed=4)
    ids[0, 15] = 0  # pad_token_id, at the first column of the fourth chunk of 5
    want = generate(model, ids, prefill_chunk_size=5)
    assert torch.equal(generate(model, ids, HybridPrefixCache(store), prefill_chunk_size=5), want)


def test_a_new_prompt_whose_first_column_is_masked_is_still_refused():
    model = build("qwen3_5")
    cache = HybridPrefixCache(PrefixStore(model, capacity="64MB", policy="marconi"))
    generate(model, tokens(1, 10, seed=5), cache)
    seen = cache.get_seq_length()
    mask = torch.ones(1, seen + 4, dtype=torch.long)
    mask[0, seen] = 0
    with pytest.raises(InvalidInputError, match="does not continue"), torch.no_grad():
        model(input_ids=tokens(1, 4, seed=6), attention_mask=mask, position_ids=torch.tensor([[1, 0, 1, 2]]),
              past_key_values=cache)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_a_later_turn_masking_a_held_token_is_refused(family):
    """A model without position_ids (Mamba, Falcon-Mamba, Mamba2) whose next turn's mask marks a token the cache
    holds as a pad (a generated pad id, masked as `ids != pad`): the held states took it in, and the turn ran as
    given, silently other tokens than the uncached model's (logits 3 apart)."""
    model = build(family)
    cache = HybridPrefixCache(PrefixStore(model, capacity="64MB", policy="marconi"))
    first = generate(model, tokens(1, 12, seed=8), cache)
    ids = torch.cat([first, tokens(1, 3, seed=9)], 1)
    mask = torch.ones_like(ids)
    mask[0, 13] = 0  # (a generated token)
    with pytest.raises(InvalidInputError, match="masks tokens this HybridPrefixCache holds"):
        generate(model, ids, cache, attention_mask=mask)
    assert not cache.started  # reset: it serves the turn again, plainly
    assert torch.equal(generate(model, ids, cache), generate(model, ids))


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_chunk_starting_at_a_pad_token_while_another_row_is_still_in_its_left_pads(family):
    """Row 0's mid-prompt pad at a chunk's first column, row 1 still padding there: row 1's first real token (position
    0) was compared with seen - its pads (< 0) and the chunk refused as a new prompt mid-generate."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", policy="marconi")
    ids = tokens(2, 30, seed=4)
    ids[1, :12] = 0  # row 1: pads only in the first two chunks of 5 and at the third's first columns
    ids[0, 10] = 0  # row 0: pad_token_id at the third chunk's first column
    mask = (ids != 0).long()
    want = generate(model, ids, attention_mask=mask, prefill_chunk_size=5)
    got = generate(model, ids, HybridPrefixCache(store), attention_mask=mask, prefill_chunk_size=5)
    assert torch.equal(got, want)
