"""A patched model under PrefixStore: states are recorded inside one forward, reuse stays exact."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hf_models import cache_argument
from recurrent_patch_models import build, tokens

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import STATE_DROPPING_MODEL_TYPES, PrefixStore
from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import patch

GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)


class CountingCache(HybridPrefixCache):
    """Counts the states patched layers hand over through the capture protocol."""

    recorded = 0

    def prefixlab_record(self, *args, **kwargs):
        CountingCache.recorded += 1
        return super().prefixlab_record(*args, **kwargs)


@pytest.mark.parametrize("name", ["qwen3_5_text", "bamba"])
def test_reuse_through_the_store_is_exact_with_states_recorded_in_one_pass(name):
    prompt = tokens(1, 40, seed=7)
    with torch.no_grad():
        expected = build(name).generate(prompt, **GREEDY)
        model = patch(build(name))
        store = PrefixStore(model, capacity="64MB")
        try:
            assert store.records_in_kernel
            CountingCache.recorded = 0
            for turn in range(2):
                cache = CountingCache(store)
                assert torch.equal(model.generate(prompt, past_key_values=cache, **GREEDY), expected)
                assert cache.reused_tokens == (0 if turn == 0 else prompt.shape[1] - 1)
            assert CountingCache.recorded > 0
        finally:
            store.close()


def logits_and_tokens(model, ids, cache=None):
    kwargs = {} if cache is None else {cache_argument(model): cache}
    with torch.no_grad():
        out = model.generate(ids, output_logits=True, return_dict_in_generate=True, **GREEDY, **kwargs)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("name", sorted(STATE_DROPPING_MODEL_TYPES))
def test_families_served_only_patched_resume_repeated_and_extended_prompts_exactly(name):
    """Jamba, Zamba, Mamba, Falcon-Mamba (their own layers restart multi-token scans from zeros, 1e-2 off at this
    unit scale): a prompt again, then extended by 9 tokens, through generate over the store: the uncached model's
    tokens and fp32 logits."""
    reference, model = build(name, seed=5), build(name, seed=5)
    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=4)
    prompt = tokens(1, 23, seed=8)
    extended = torch.cat([prompt, tokens(1, 9, seed=9)], dim=1)
    try:
        for ids, reusable in [(prompt, 0), (prompt, 20), (extended, 20)]:  # (vllm+: states at block ends)
            cache = HybridPrefixCache(store)
            got_tokens, got_logits = logits_and_tokens(model, ids, cache)
            want_tokens, want_logits = logits_and_tokens(reference, ids)
            assert torch.equal(got_tokens, want_tokens) and cache.reused_tokens == reusable
            torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
    finally:
        store.close()


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "transformers-layers"])
def test_decode_steps_that_compute_as_prefills_are_served_where_patched_layers_tell(patched):
    """Nemotron-H with dt_bias raised so that no dt reaches the clamp: patched layers report that its decode steps
    computed what a prefill would, so a chat turn reuses the whole previous turn; transformers' layers cannot tell, so
    the store keeps only the prompt. Exact both ways."""
    reference, model = build("nemotron_h", seed=3), build("nemotron_h", seed=3)
    for each in (reference, model):
        for layer in each.modules():
            if hasattr(layer, "time_step_limit"):
                layer.dt_bias.data += 8.0
    store = PrefixStore(model, capacity="64MB", policy="sglang+", block_size=4, patch=patched)
    try:
        prompt = tokens(1, 12, seed=1)
        first_cache = HybridPrefixCache(store)
        first, _ = logits_and_tokens(model, prompt, first_cache)
        assert first_cache.report().decoded_left_out == (0 if patched else 3)
        turn = torch.cat([first, tokens(1, 3, seed=2)], dim=1)
        cache = HybridPrefixCache(store)
        sequences, logits = logits_and_tokens(model, turn, cache)
        expected = logits_and_tokens(reference, turn)
        assert torch.equal(sequences, expected[0])
        torch.testing.assert_close(logits, expected[1], rtol=0, atol=1e-5)
        assert cache.reused_tokens == (first.shape[1] - 1 if patched else prompt.shape[1])
    finally:
        store.close()


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "transformers-layers"])
def test_decode_steps_that_differ_from_prefills_are_never_served(patched):
    """Zamba2 (like Nemotron-H) clamps dt in a prefill, not in a decode step (model_info.decode_differs_from_prefill):
    where the clamp bites, a decoded token's state is not what a later prompt's prefill computes there. The store
    serves the next chat turn only the prompt before it, and a repeated prompt resumes two tokens before its end (one
    token over a cached state would run as a decode step). Unit-scale weights: the clamp bites in these decode steps
    and changes the logits by up to 1e-4."""
    reference, model = build("zamba2", seed=3), build("zamba2", seed=3)
    store = PrefixStore(model, capacity="64MB", policy="sglang+", block_size=4, patch=patched)
    left_out = 0  # decoded tokens the requests' reports say were left out: what store.stats() counts
    try:
        assert store.decode_differs
        for seed in range(4):
            prompt = tokens(1, 12, seed=seed)
            first_cache = HybridPrefixCache(store)
            first, _ = logits_and_tokens(model, prompt, first_cache)
            report = first_cache.report()  # commits: the 3 tokens fed after the prompt were decoded, not admitted
            assert report.decoded_left_out == first.shape[1] - 1 - prompt.shape[1] == 3
            assert "its last 3 decoded tokens left out" in str(report)
            left_out += report.decoded_left_out
            turn = torch.cat([first, tokens(1, 3, seed=100 + seed)], dim=1)
            expected = logits_and_tokens(reference, turn)
            for served_as in ("turn", "repeat"):
                cache = HybridPrefixCache(store)
                sequences, logits = logits_and_tokens(model, turn, cache)
                assert torch.equal(sequences, expected[0])
                torch.testing.assert_close(logits, expected[1], rtol=0, atol=1e-5)
                # the turn resumes at the prompt's end (patched layers saw a decode step skip a clamp); the repeat
                # from the state its own prefill left 2 tokens before its end (patched layers record it;
                # transformers' layers keep the prompt's)
                repeat = turn.shape[1] - 2 if patched else prompt.shape[1]
                assert cache.reused_tokens == (prompt.shape[1] if served_as == "turn" else repeat)
                left_out += cache.report().decoded_left_out
        assert store.stats()["decoded_tokens_left_out"] == left_out >= 12
        store.core.check_invariants()
    finally:
        store.close()


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "transformers-layers"])
def test_use_cache_false_is_refused_where_decode_steps_differ_from_prefills(patched):
    """generate(use_cache=False) feeds the whole sequence again at every step; over a HybridPrefixCache the hooks
    cut it to the new token, a decode step. Before: on Zamba2 (dt clamped in prefills only) the steps' logits were
    silently off by up to 7e-5 from the uncached use_cache=False run. Now refused before anything is looked up; a
    model whose decode steps compute as prefills (Bamba) is still served within 1e-5."""
    from prefixlab.errors import InvalidInputError

    prompt = tokens(1, 20, seed=7)
    for name in ("zamba2", "bamba"):
        reference, model = build(name, seed=3), build(name, seed=3)
        store = PrefixStore(model, capacity="64MB", policy="dp", block_size=4, patch=patched)
        try:
            for _ in range(2):  # (transformers' layers capture the state a repeat resumes from at the second)
                logits_and_tokens(model, prompt, HybridPrefixCache(store))
            before = store.stats()
            cache = HybridPrefixCache(store)
            with torch.no_grad():
                options = dict(GREEDY, use_cache=False, output_logits=True, return_dict_in_generate=True)
                if store.decode_differs:
                    with pytest.raises(InvalidInputError, match="use_cache=False"):
                        model.generate(prompt, past_key_values=cache, **options)
                    assert store.stats() == before
                    first = model.generate(prompt, past_key_values=cache, **GREEDY)  # a chat's next turn too
                    with pytest.raises(InvalidInputError, match="use_cache=False"):  # (was 9e-5 off)
                        model.generate(torch.cat([first, tokens(1, 6, seed=8)], 1), past_key_values=cache, **options)
                    continue
                got, expected = (m.generate(prompt, **options, **kw) for m, kw in
                                 ((model, {"past_key_values": cache}), (reference, {})))
            assert cache.reused_tokens == prompt.shape[1] - 1 and torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
        finally:
            store.close()


@pytest.mark.parametrize("own_tokens", [1, 3])
def test_hydragen_from_the_store_leaves_a_prefill_where_decode_steps_differ(own_tokens):
    """hydragen_cache_from_store on Nemotron-H (dt clamped in prefills only) serves at most all but the prompt's
    last two tokens, so generate's first forward is a prefill: its logits equal the uncached model's."""
    from prefixlab.attention.compose import hydragen_cache_from_store

    reference, model = build("nemotron_h"), build("nemotron_h")
    model.set_attn_implementation("hydragen")
    store = PrefixStore(model, capacity="64MB", policy="sglang+", block_size=4)
    try:
        prefix = tokens(1, 19, seed=0)
        logits_and_tokens(model, prefix, HybridPrefixCache(store))  # the store holds a state after 18 tokens
        for seed in range(3):
            prompt = torch.cat([prefix, tokens(1, own_tokens, seed=10 + seed)], dim=1)
            cache = hydragen_cache_from_store(store, prompt, batch_size=1)
            assert 0 < cache.get_seq_length() <= prompt.shape[1] - 2
            sequences, logits = logits_and_tokens(model, prompt, cache)
            expected = logits_and_tokens(reference, prompt)
            assert torch.equal(sequences, expected[0])
            torch.testing.assert_close(logits, expected[1], rtol=0, atol=1e-5)
    finally:
        store.close()


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run inside it that are not views (on a GPU, roughly the kernel launches)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["qwen3_5_text", "bamba"])
def test_a_decode_step_through_the_store_runs_no_more_ops_than_transformers_own(name):
    # A decode step through a chunked kernel pads its one token to a whole chunk (~3x the kernels of the token loop
    # for the delta rule): on a GPU that cost ~110 ms a request (benchmarks/RESULTS.md, "GPU"). Counted as the ops
    # of 9 new tokens minus those of 1, so that only the 8 decode steps count; the store's bookkeeping adds a few
    # (3 % / 8 % here, position and mask checks), the chunked-kernel decode ~30 % (1,884 / 1,396 against 1,456 / 1,056).
    prompt = tokens(1, 40, seed=7)
    plain, model = build(name), patch(build(name))
    store = PrefixStore(model, capacity="64MB")

    def ops(new_tokens: int, cached: bool) -> int:
        options = dict(GREEDY, max_new_tokens=new_tokens)
        with torch.no_grad(), CountOps() as counter:
            if cached:
                model.generate(prompt, past_key_values=HybridPrefixCache(store), **options)
            else:
                plain.generate(prompt, **options)
        return counter.count

    try:
        ops(9, True)  # the first request admits; the counted ones resume the same prompt
        decode = {cached: ops(9, cached) - ops(1, cached) for cached in (False, True)}
    finally:
        store.close()
    assert 0 < decode[True] <= 1.15 * decode[False], decode


@pytest.mark.parametrize("by_hand", [False, True])
def test_a_layer_replaced_under_the_store_is_patched_at_the_next_request(by_hand):
    """A linear-attention module put into a patched model (here a fresh copy of one) ran transformers' forward,
    which records no states: every request's admission then failed (InvalidInputError from cache.report(), a
    warning at the store's next use). The store patches it, with the backend the other layers run, at the next
    request: the store empties (new weights), then reuses again, exactly; close() (or unpatch) restores it."""
    import copy

    from prefixlab.recurrent.patch import is_patched, unpatch

    prompt = tokens(1, 30, seed=3)
    model = build("qwen3_5_text")
    if by_hand:
        patch(model, backend="naive")
    store = PrefixStore(model, capacity="64MB", block_size=4)
    layer = next(layer for layer in model.model.layers if hasattr(layer, "linear_attn"))
    with torch.no_grad():
        model.generate(prompt, past_key_values=HybridPrefixCache(store), **GREEDY)
        layer.linear_attn = copy.deepcopy(layer.linear_attn)
        vars(layer.linear_attn).pop("_prefixlab_original_forward")  # as built fresh: its own forward
        vars(layer.linear_attn).pop("forward")
        assert not is_patched(layer.linear_attn)
        served = []
        for _ in range(2):
            cache = HybridPrefixCache(store)
            with pytest.warns(RuntimeWarning, match="weights changed") if not served else contextlib.nullcontext():
                served.append(model.generate(prompt, past_key_values=cache, **GREEDY))
            assert cache.report().admission.startswith("admitted")
        assert is_patched(layer.linear_attn) and cache.reused_tokens == prompt.shape[1] - 1
        assert vars(layer.linear_attn)["forward"].backend == ("naive" if by_hand else "auto")
        store.close()
        if by_hand:
            unpatch(model)
        assert not is_patched(model)
        expected = model.generate(prompt, **GREEDY)
    assert all(torch.equal(out, expected) for out in served)


def test_a_later_turns_decode_steps_that_differ_leave_out_only_their_own_tokens():
    """A chat continued on one cache, over patched Nemotron-H layers whose first turn decoded as a prefill would and
    whose second turn's decode steps differ (flagged so here, as where the dt clamp bites). Before: the second
    commit left out everything from the first turn's decode start, so the report and store.stats() counted the
    first turn's admitted decoded tokens as left out (10 instead of 3) and the second turn's prompt, prefilled from
    exact states, was never admitted. Now only the second turn's decoded tokens are left out."""
    reference, model = build("nemotron_h", seed=3), build("nemotron_h", seed=3)
    for each in (reference, model):
        for layer in each.modules():
            if hasattr(layer, "time_step_limit"):
                layer.dt_bias.data += 8.0
    store = PrefixStore(model, capacity="64MB", policy="sglang+", block_size=4)
    try:
        cache = HybridPrefixCache(store)
        first, _ = logits_and_tokens(model, tokens(1, 12, seed=1), cache)
        assert cache.report().decoded_left_out == 0
        flag = cache.prefixlab_decode_differs
        cache.prefixlab_decode_differs = lambda differs: flag(torch.ones_like(differs))
        turn = torch.cat([first, tokens(1, 4, seed=2)], dim=1)
        sequences, logits = logits_and_tokens(model, turn, cache)
        expected = logits_and_tokens(reference, turn)
        assert torch.equal(sequences, expected[0])
        torch.testing.assert_close(logits, expected[1], rtol=0, atol=1e-5)
        decoded = sequences.shape[1] - 1 - turn.shape[1]
        assert cache.report().decoded_left_out == store.stats()["decoded_tokens_left_out"] == decoded == 3
        again = HybridPrefixCache(store)
        logits_and_tokens(model, turn, again)
        assert again.reused_tokens > first.shape[1]  # (the second turn's prompt was admitted)
        store.core.check_invariants()
    finally:
        store.close()


@pytest.mark.parametrize("patched", [True, False])
def test_a_layer_replaced_by_a_module_that_keeps_no_state_is_named(patched):
    """A linear-attention layer replaced by a module that writes no state to the cache (no linear-attention layer
    patch_new_layers could patch): generate is the model's own, and admitting it fails. Before: "states[6] must hold
    a conv state for each recurrent layer [0] ..." (an argument check of store.admit, which the caller never
    called). Now the error names the layer that kept no state and why."""

    class Stateless(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return torch.zeros_like(hidden_states)

    prompt = tokens(1, 30, seed=3)
    model = build("qwen3_5_text")
    store = PrefixStore(model, capacity="64MB", block_size=4, patch=patched)
    model.model.layers[0].linear_attn = Stateless()
    with torch.no_grad():
        expected = model.generate(prompt, **GREEDY)
        cache = HybridPrefixCache(store)
        with pytest.warns(RuntimeWarning, match="weights changed"):
            assert torch.equal(model.generate(prompt, past_key_values=cache, **GREEDY), expected)
    with pytest.raises(InvalidInputError, match=r"recurrent layer\(s\) \[0\] kept no state in the cache"):
        cache.report()
    with pytest.warns(RuntimeWarning, match="not admitted: the model's recurrent layer"):  # (close admits it again)
        store.close()
