"""HybridPrefixCache on left-padded batches: each row resumes from its own cached prefix at one common padded
column (rows without one start fresh), exact against the same batched generate without prefixlab."""

import pytest
import recurrent_patch_models
import torch
from hf_models import FAMILIES, build, cache_argument, reference_cache
from test_hf_cache import generate, new_store, tokens

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.rows import PADS_ONLY, left_pads, resolve_pads
from prefixlab.cache.store import STATE_DROPPING_MODEL_TYPES, PrefixStore


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch (pad id 0) and its attention mask from 1-D prompts of different lengths."""
    width = max(len(row) for row in rows)
    batch, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return batch, mask


def padded_model(family: str):
    from prefixlab.recurrent import patch

    return patch(build("qwen3_5")) if family == "qwen3_5-patched" else build(family)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5-patched", "bamba", "llama"])
def test_left_padded_batch_reuses_each_rows_prefix_exactly_and_admits_the_rows(family):
    """Rows of different lengths, left-padded: each resumes from its own deepest cached checkpoint, as alone (the
    rows whose checkpoints sit at other columns are first prefilled alone up to the batch's column: align.py), tokens
    and fp32 logits match the same batched generate without prefixlab, and every row is admitted without its pads."""
    model = padded_model(family)
    store = new_store(model)
    system = tokens(14, seed=40)
    cached = [torch.cat([system, tokens(5, seed=41)]), torch.cat([system, tokens(3, seed=42)])]
    for prompt in cached:  # checkpoints at 14 (branch point) and at each prompt's last-but-one token (18, 16)
        generate(model, prompt[None], HybridPrefixCache(store))
    rows = [torch.cat([cached[0], tokens(4, seed=43)]),  # 23 tokens, no pads
            torch.cat([cached[1], tokens(2, seed=44)]),  # 19 tokens, 4 pads
            tokens(4, seed=45)]  # nothing cached, 19 pads
    batch, mask = left_pad(rows)
    store.flush()
    alone = [store.core.peek(row[:-1].numpy())[0] for row in rows]  # each row's deepest checkpoint
    options = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    cache = HybridPrefixCache(store)
    got, expected = generate(model, batch, cache, **options), generate(model, batch, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # before align.py, one common column: [19, 15, 0] (llama) and [18, 14, 0]
    assert cache.rows_reused == alone and alone[0] > 18 and alone[1] > (15 if family == "llama" else 14)
    store.core.check_invariants()
    for row, prompt in enumerate(rows):  # admitted without pads: the row's next turn resumes from its whole output
        follow = torch.cat([prompt, expected.sequences[row, batch.shape[1]:]])[None]
        single = HybridPrefixCache(store)
        no_eos = dict(eos_token_id=None)  # the follow-up holds no pad id (generate would mask it)
        assert torch.equal(generate(model, follow, single, **no_eos), generate(model, follow, **no_eos))
        assert single.reused_tokens == follow.shape[1] - 1


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_left_padded_batch_whose_longest_row_is_new_runs_exactly(family):
    """The longest row (no pads) has nothing cached, so one common column would be 0 and the batch would reuse
    nothing; the rows are prefilled alone up to the batch's column first (align.py): the short row reuses its cached
    prefix, the new row none (reported cold), exactly, and both rows are admitted."""
    model = padded_model(family)
    store = new_store(model)
    short = tokens(10, seed=50)
    generate(model, short[None], HybridPrefixCache(store))
    batch, mask = left_pad([tokens(16, seed=51), torch.cat([short, tokens(2, seed=52)])])
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(model, batch, cache, attention_mask=mask), generate(model, batch, attention_mask=mask))
    store.flush()
    assert cache.rows_reused == [0, 10] and [row.reason for row in cache.report().rows] == ["cold", "hit"]
    assert store.stats()["sequences"] == 3 and store.stats()["reused_tokens"] == 10  # (the primes are not counted)
    single = HybridPrefixCache(store)
    generate(model, batch[:1], single)
    assert single.reused_tokens == 15


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_random_left_padded_batches_stay_exact_with_beams_and_return_sequences(family):
    """Batches of 1-4 rows cut from three shared prompts plus fresh tails, left-padded; greedy, beam search, sampled
    num_return_sequences: every batch matches the uncached batched generate (tokens, fp32 logits), and what it admits
    keeps later batches exact."""
    import random

    model, rng = padded_model(family), random.Random(0)
    store = new_store(model)
    bases = [tokens(rng.randint(4, 20), seed=100 + i) for i in range(3)]
    reused = 0
    for step in range(12):
        rows = []
        for _ in range(rng.randint(1, 4)):
            base = bases[rng.randrange(3)]
            tail = tokens(rng.randint(0, 6), seed=1000 + 10 * step + len(rows))
            rows.append(torch.cat([base[: rng.randint(1, len(base))], tail]))
        batch, mask = left_pad(rows)
        options = [{}, dict(num_beams=2), dict(num_return_sequences=2, do_sample=True)][step % 3]
        options |= dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
        cache = HybridPrefixCache(store)
        torch.manual_seed(step)
        got = generate(model, batch, cache, **options)
        torch.manual_seed(step)
        expected = generate(model, batch, **options)
        assert torch.equal(got.sequences, expected.sequences)
        for mine, theirs in zip(got.logits, expected.logits, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        reused += sum(cache.rows_reused)
        store.core.check_invariants()
    assert reused > 0


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_left_padded_direct_forward_reuses_only_with_real_position_ids(family):
    """Cached KV holds real positions 0, 1, ...: a padded forward without position_ids (the model then counts
    columns, pads included) runs uncached and admits nothing; with the real positions (as generate passes) it reuses,
    and its logits match the uncached forward."""
    model = padded_model(family)
    store = new_store(model)
    first = tokens(12, seed=60)
    generate(model, first[None], HybridPrefixCache(store))
    batch, mask = left_pad([torch.cat([first, tokens(3, seed=61)]), tokens(4, seed=62)])
    with torch.no_grad():
        cache = HybridPrefixCache(store)
        logits = model(input_ids=batch, attention_mask=mask, past_key_values=cache).logits
        assert cache.reused_tokens == 0 and cache.commit() == 0
        torch.testing.assert_close(logits, model(input_ids=batch, attention_mask=mask).logits, atol=1e-5, rtol=0)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = HybridPrefixCache(store)
        logits = model(input_ids=batch, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
        assert cache.rows_reused[0] >= 11
        expected = model(input_ids=batch, attention_mask=mask, position_ids=positions).logits[:, -logits.shape[1]:]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


UNPATCHED = [f for f in FAMILIES if f not in STATE_DROPPING_MODEL_TYPES and f not in ("llama", "qwen3")]


def with_trained_pad_embedding(model):
    """The random init zeroes the pad token's embedding (nn.Embedding padding_idx), which hides pads that reach a
    recurrent state; a trained model's pad embedding is not zero."""
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_(generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("family", UNPATCHED)
def test_left_padded_batch_with_transformers_layers_is_exact(family):
    """patch=False splits the prefill at every planned capture (vllm+ with 2-token blocks: nearly every column).
    Splits that would leave a one-token segment at a row's pad column (transformers does not mask pads out of a
    one-token forward) are skipped: the batch matches the uncached batched generate, and what it admits serves a
    later single-row request exactly."""
    model = with_trained_pad_embedding(build(family))

    def run(input_ids, cache=None, **options):
        served = {cache_argument(model): cache} if cache is not None else {}
        return model.generate(input_ids, do_sample=False, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True, **served, **options)

    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=2, patch=False)
    rows = [tokens(12, seed=1), tokens(4, seed=2), tokens(11, seed=3)]  # pads 0, 8, 1: columns 2-7 pad row 1
    batch, mask = left_pad(rows)
    options = dict(attention_mask=mask, eos_token_id=None, max_new_tokens=3)
    got, expected = run(batch, HybridPrefixCache(store), **options), run(batch, reference_cache(model), **options)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    follow = torch.cat([rows[1], expected.sequences[1, batch.shape[1]:-1], tokens(3, seed=4)])[None]
    cache = HybridPrefixCache(store)
    single, reference = run(follow, cache, max_new_tokens=3), run(follow, max_new_tokens=3)
    assert cache.reused_tokens >= 4 and torch.equal(single.sequences, reference.sequences)
    for mine, theirs in zip(single.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_a_row_of_pads_only_keeps_two_tokens_in_the_forward_after_a_hit():
    """A row without a real token would be fed unmasked by a one-token forward (transformers masks pads only in
    longer forwards): the other rows resume, but short of their last two tokens, so the forward after the hit
    masks it; the batch matches the uncached one exactly and only the real row is admitted."""
    model = with_trained_pad_embedding(build("qwen3_5"))
    store = new_store(model)
    prompt = tokens(9, seed=1)
    generate(model, prompt[None], HybridPrefixCache(store))
    batch = torch.stack([torch.cat([prompt, tokens(1, seed=3)]), torch.zeros(10, dtype=torch.long)])
    mask = torch.stack([torch.ones(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)])
    options = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    cache = HybridPrefixCache(store)
    got, expected = generate(model, batch, cache, **options), generate(model, batch, **options)
    assert cache.rows_reused == [8, 0] and torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # row 0 was admitted (prompt + output but its last token), row 1 (only its output is real) was not
    for served, reusable in ((got.sequences[0], 14), (got.sequences[1, 10:], 0)):
        alone = HybridPrefixCache(store)
        generate(model, served[None], alone)
        assert alone.reused_tokens == reusable
    store.core.check_invariants()


@pytest.mark.parametrize(("family", "patch"), [("qwen3_5_text", True), ("qwen3_5_text", False), ("bamba", False),
                                               ("llama", True)])
def test_chunked_prefill_of_a_row_whose_pads_fill_the_first_chunks_reuses_exactly(family, patch):
    """generate(prefill_chunk_size=8) on a batch whose short row pads its first two chunks (17 pads): that row is
    pads only in those forwards, takes its pads from a later chunk's mask, and both rows resume (before: the batch
    ran uncached); tokens and fp32 logits match transformers' own chunked prefill, and the short row is admitted at
    its real positions (its prompt and output served alone resume all but the last token)."""
    from transformers import DynamicCache

    model = build(family) if family == "llama" else recurrent_patch_models.build(family, seed=3)
    model = with_trained_pad_embedding(model)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=patch)

    def run(input_ids, cache, **options):
        return model.generate(input_ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                              prefill_chunk_size=8, **options)

    def text(n, seed):
        return tokens(n, seed=seed) % 57 + 3

    system, other = text(30, 70), text(13, 71)
    for head, seed in ((system, 72), (system, 73), (other, 74), (other, 75)):  # branch checkpoints at 30 and 13
        run(torch.cat([head, text(4, seed)])[None], HybridPrefixCache(store))
    short, long = torch.cat([other, text(20, 76)]), torch.cat([system, text(20, 77)])  # 33 and 50 tokens
    batch, mask = left_pad([short, long])
    cache = HybridPrefixCache(store)
    got = run(batch, cache, attention_mask=mask)
    expected = run(batch, DynamicCache(config=model.config), attention_mask=mask)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # column 30: where the long row leaves the cached prefixes, and the short row at its real position 13 (17 pads)
    assert cache.rows_reused == [13, 30]
    follow = got.sequences[0, batch.shape[1] - len(short):][None]
    alone = HybridPrefixCache(store)
    single = run(follow, alone)
    assert alone.reused_tokens == follow.shape[1] - 1
    assert torch.equal(single.sequences, run(follow, DynamicCache(config=model.config)).sequences)
    store.core.check_invariants()


def test_pads_of_a_pads_only_row_come_from_a_later_mask_that_agrees():
    """rows.resolve_pads: a row of pads only so far starts where a later forward's mask says, at its real positions;
    a mask that contradicts the pads known (or is missing), or wrong positions for the starting row, give None."""
    mask = torch.tensor([[0] * 10 + [1] * 2, [1] * 12])
    assert left_pads(mask[:, :8], 2, 8) is None
    assert left_pads(mask[:, :8], 2, 8, pads_only_rows=True) == [PADS_ONLY, 0]
    positions = torch.tensor([[1, 1, 0, 1], [8, 9, 10, 11]])  # columns 8-11; row 0's real tokens at 10 and 11
    assert resolve_pads([PADS_ONLY, 0], mask, positions, 8, 12, True) == [10, 0]
    assert resolve_pads([PADS_ONLY, 0], mask[:, :10], positions[:, :2], 8, 10, True) == [PADS_ONLY, 0]
    assert resolve_pads([PADS_ONLY, 0], mask, torch.tensor([[1, 1, 2, 3], [8, 9, 10, 11]]), 8, 12, True) is None
    assert resolve_pads([PADS_ONLY, 0], mask, None, 8, 12, True) is None  # the model would count columns
    assert resolve_pads([PADS_ONLY, 0], mask, None, 8, 12, False) == [10, 0]  # no attention: positions unused
    assert resolve_pads([PADS_ONLY, 1], mask, positions, 8, 12, True) is None  # row 1 had a pad
    assert resolve_pads([PADS_ONLY, 0], None, positions, 8, 12, True) is None  # row 0 cannot start at column 0


def test_a_later_forward_without_the_mask_admits_nothing_of_a_pads_only_request():
    """Direct forwards of a padded prompt in two chunks: the first has a row of pads only; the second, without the
    attention mask, cannot say where that row starts, so nothing of the request is admitted; the logits still match
    the same two forwards without prefixlab."""
    from transformers import DynamicCache

    model = with_trained_pad_embedding(build("qwen3_5"))
    store = new_store(model)
    batch, mask = left_pad([tokens(3, seed=80), tokens(12, seed=81)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        outputs = []
        for cache in (HybridPrefixCache(store), DynamicCache(config=model.config)):
            first = model(input_ids=batch[:, :8], attention_mask=mask[:, :8], position_ids=positions[:, :8],
                          past_key_values=cache).logits
            second = model(input_ids=batch[:, 8:], position_ids=positions[:, 8:], past_key_values=cache).logits
            outputs.append((first, second, cache))
    (first, second, cache), (want_first, want_second, _) = outputs
    torch.testing.assert_close(first, want_first, atol=1e-5, rtol=0)
    torch.testing.assert_close(second, want_second, atol=1e-5, rtol=0)
    assert cache.commit() == 0 and cache.report().admission == "not admitted (refused input)"
    assert store.core.stats()["nodes"] == 0


def primed_in_a_small_store(states: int, kv_tokens: int):
    """(store, run, batch, mask): a store with room for `states` states and `kv_tokens` tokens of KV
    holding a 40-token system prompt's branch point; `batch` two rows of it plus 3 and 9 tokens, left-padded."""
    from prefixlab.cache.costmodel import ModelSpec

    model = recurrent_patch_models.build("qwen3_5_text", seed=3)
    spec = ModelSpec.from_config(model.config, dtype=model.dtype)
    store = PrefixStore(model, capacity=states * spec.state_bytes + kv_tokens * spec.kv_bytes_per_token,
                        policy="marconi", block_size=4)

    def run(input_ids, cache, **options):
        return model.generate(input_ids, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0,
                              **options)

    system = tokens(40, seed=90) % 57 + 3
    for seed in (91, 92):
        run(torch.cat([system, tokens(3, seed=seed) % 57 + 3])[None], HybridPrefixCache(store))
    batch, mask = left_pad([torch.cat([system, tokens(n, seed=93 + n) % 57 + 3]) for n in (3, 9)])
    return store, run, batch, mask


def test_a_prime_does_not_evict_the_state_an_earlier_prime_of_the_batch_left():
    """A store with room for four states and 60 tokens of KV: priming the second row would evict the first row's
    primed state (then neither row reuses anything); the primed states are held until the batch looked them up."""
    store, run, batch, mask = primed_in_a_small_store(4, 60)
    cache = HybridPrefixCache(store)
    assert torch.equal(run(batch, cache, attention_mask=mask), run(batch, None, attention_mask=mask))
    assert cache.rows_reused == [40, 40] and store.stats()["evictions"] > 0
    store.core.check_invariants()


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_rows_under_one_cached_prompt_are_primed_together_in_one_right_padded_forward(family):
    """Rows of one cached prompt plus questions of 7, 8 and 9 tokens, left-padded: the prompt's checkpoint sits at
    another column in each row. The rows are primed together (align.py: one forward, right-padded, each row's
    state captured at its own end by the patched layers), then the batch resumes every row at its last column:
    tokens and fp32 logits equal the uncached batched generate, and the primes are not counted as requests."""
    model = padded_model(family)
    store = new_store(model)
    system = tokens(24, seed=60)
    for seed in (61, 62):  # a branch point at 24: the prompt's checkpoint
        generate(model, torch.cat([system, tokens(3, seed=seed)])[None], HybridPrefixCache(store))
    batch, mask = left_pad([torch.cat([system, tokens(n, seed=63 + n)]) for n in (7, 8, 9)])  # pads 2, 1, 0
    shapes = []
    counter = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                              with_kwargs=True)  # (after the store's hook: the columns it runs)
    options = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    cache = HybridPrefixCache(store)
    try:
        got = generate(model, batch, cache, **options)
    finally:
        counter.remove()
    expected = generate(model, batch, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # one prime of columns 24..31 for all three rows (real tokens 6, 7 and 8), then the batch from column 32
    assert shapes[:2] == [(3, 8), (3, 1)] and all(shape[0] == 3 for shape in shapes)
    assert cache.rows_reused == [24, 24, 24] and [r.reason for r in cache.report().rows] == ["hit"] * 3
    store.flush()
    assert store.stats()["sequences"] == 5 and store.stats()["reused_tokens"] == 72
    store.core.check_invariants()
    for row, end in enumerate([30, 31, 32]):  # each row's state at its prime's end, admitted without pads
        assert store.core.peek(batch[row, mask[row].bool()][:end].numpy())[0] == end


def test_primes_are_bucketed_so_that_pads_stay_within_their_share():
    from prefixlab.cache.align import padded_buckets

    assert padded_buckets(list("abc"), [1, 4, 8], None) == [["c", "b", "a"]]
    assert padded_buckets(list("abc"), [1, 4, 8], 0.25) == [["c"], ["b"], ["a"]]  # 16 > 1.25 * 12, 8 > 1.25 * 5
    assert padded_buckets(list("abcd"), [6, 8, 7, 2], 0.25) == [["b", "c", "a"], ["d"]]  # 24 <= 26.25; 32 > 28.75
    assert padded_buckets([], [], 0.25) == [] and padded_buckets(["a"], [3], 0.0) == [["a"]]


def test_right_padded_rows_are_recognised_only_with_their_ends():
    from prefixlab.cache.rows import right_padded

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert right_padded(mask, [2, 3], 3)
    assert not right_padded(mask, [3, 3], 3) and not right_padded(mask, [2, 2], 3)
    assert not right_padded(None, [2, 3], 3) and not right_padded(mask, [0, 3], 3)
    assert not right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]]), [2, 3], 3)


def test_a_row_whose_primed_state_a_later_row_evicted_is_primed_again_alone(monkeypatch):
    """A store with room for two states: admitting the second row of a batched prime evicts the first row's state,
    so each row is primed again alone (and the batch, which still cannot hold both, runs exactly from what is left)."""
    import prefixlab.cache.align as align

    primes, prime = [], align._prime
    monkeypatch.setattr(align, "CPU_PRIME_PADDING", 1.0)  # (2 and 8 tokens: at 0.25 a CPU primes them apart)
    monkeypatch.setattr(align, "_prime", lambda *args: primes.append([len(row) for row in args[3]]) or prime(*args))
    store, run, batch, mask = primed_in_a_small_store(2, 44)
    primes.clear()
    with pytest.warns(RuntimeWarning, match="does not fit"):
        assert torch.equal(run(batch, HybridPrefixCache(store), attention_mask=mask),
                           run(batch, None, attention_mask=mask))
    assert primes == [[48, 42], [48], [42]]  # (longest first)
    store.core.check_invariants()
