"""Bad input, checked systematically: every public entry point that touches a PrefixStore or a HybridPrefixCache,
called with malformed arguments on a store that already holds entries (both tiers where it has two; several
families; marconi and dp), raises one of prefixlab's errors that says what to do (or transformers' own error for
input transformers itself refuses), leaves everything observable about the store as it was (tests/store_snapshot.py:
entries and tensor digests, node bookkeeping, policy counters and indexes, counts, the model's hooks and patch), and
the next valid request still gives the uncached model's greedy tokens."""

import copy
import warnings

import pytest
import torch
from hf_models import build, generate, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_helpers import PrefixState, TokenKV, dp_core
from store_snapshot import diff, snapshot, tier

import prefixlab
from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError, PrefixlabError

# (family, policy, offload tier): attention + GatedDeltaNet / Mamba2 / short convs, and KV only
SERVED = [("qwen3_5", "marconi", True), ("bamba", "dp", False), ("lfm2", "dp", True), ("llama", "marconi", False)]
PROMPTS = [tokens(1, 20, seed=seed) for seed in range(3)]


@pytest.fixture(scope="module", params=SERVED, ids=lambda p: f"{p[0]}-{p[1]}{'-offload' if p[2] else ''}")
def served(request):
    """(model, store, a probe prompt, its uncached greedy output, the family): the store holds the three prompts'
    entries; with an offload tier, a device budget of about one entry, so the host tier holds the others."""
    family, policy, offload = request.param
    model = build(family)
    capacity = "64MB"
    if offload:  # one entry's bytes, measured
        probe = PrefixStore(model, capacity="64MB", policy=policy, block_size=4)
        generate(model, PROMPTS[0], HybridPrefixCache(probe))
        capacity = probe.stats()["used_bytes"] * 3 // 2
        probe.close()
    store = PrefixStore(model, capacity=capacity, policy=policy, block_size=4,
                        offload_capacity="8MB" if offload else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for prompt in PROMPTS:
            generate(model, prompt, HybridPrefixCache(store))
        store.flush()
    assert store.core.used_bytes > 0 and (not offload or store.offload.used_bytes > 0)
    probe_prompt = PROMPTS[0][:, :16].clone()
    yield model, store, probe_prompt, generate(model, probe_prompt), family
    store.close()


def refused(store, call, error=PrefixlabError, match=None) -> BaseException:
    """`call()` raises `error` (matching `match`) and changes nothing about `store`."""
    store.flush()
    before = snapshot(store)
    with pytest.raises(error, match=match) as raised:
        call()
    changed = diff(before, snapshot(store))
    assert not changed, f"{call}: the refused call changed {changed}"
    return raised.value


def still_exact(served) -> None:
    model, store, prompt, expected, _ = served
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), expected)
    store.flush()
    store.core.check_invariants()
    assert store.stats()["locked_matches"] == 0


BAD_TOKENS = st.one_of(
    st.lists(st.integers(max_value=-1), min_size=1, max_size=4).map(lambda xs: [5, *xs]),  # a negative id
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=4),  # float ids
    st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=3), min_size=1, max_size=3),  # 2-D (or ragged)
    st.text(max_size=5), st.none(), st.integers(0, 100), st.just([2**64 - 1]),
)
BAD_NAMESPACES = st.one_of(st.just(""), st.none(), st.integers(), st.binary(min_size=1, max_size=3))


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=BAD_TOKENS, namespace=BAD_NAMESPACES)
def test_lookups_and_admissions_refuse_bad_tokens_and_namespaces(served, bad, namespace):
    store, good = served[1], PROMPTS[0][0].tolist()
    for call in (lambda: store.lookup(bad), lambda: store.match(bad), lambda: store.lookup(good, namespace),
                 lambda: store.match_offloaded(bad, "default", 0), lambda: store.match_offloaded(good, namespace, 0),
                 lambda: store.admit(bad, lambda a, b: None, {}), lambda: store.admit(good, lambda a, b: None, {},
                                                                                     namespace=namespace)):
        if store.offload is None and "match_offloaded" in call.__code__.co_names:
            continue  # (no host tier: nothing to match)
        refused(store, call, InvalidInputError)


def test_store_methods_refuse_bad_arguments_and_change_nothing(served, tmp_path):
    model, store = served[0], served[1]
    good = PROMPTS[1][0].tolist()
    released = store.match(good)
    store.release(released)
    for call, match in [
        (lambda: store.match_offloaded(good, "default", "x"), "longer_than"),  # (was a raw TypeError, a host lock)
        (lambda: store.match_offloaded(good, "default", 1.5), "longer_than"),
        (lambda: store.release(object()), "live Match"),
        (lambda: store.release(released), "live Match"),  # twice
        (lambda: store.release_lookup(released, released), "live Match"),
        (lambda: store.plan(good, released), "live Match"),
        (lambda: store.explain(good, released), "live Match"),  # (was a raw AttributeError)
        (lambda: store.explain(good, object()), "live Match"),
        (lambda: store.admit(good, lambda a, b: None, "x"), "states must be a dict"),  # (a raw AttributeError)
        (lambda: store.admit(good, lambda a, b: None, [(3, None)]), "states must be a dict"),
        (lambda: store.admit(good, "kv", {}), "kv must be a callable"),
        (lambda: store.hold(object()), "commit"),  # (was kept: every later use of the store then failed)
        (lambda: store.save(tmp_path), "file path"),
        (lambda: store.save(tmp_path / "missing" / "x.safetensors"), "existing directory"),
        (lambda: store.save(None), "file path"),
        (lambda: PrefixStore.load(tmp_path / "missing.safetensors", model), "not a file written"),
        (lambda: PrefixStore(model, capacity="lots"), "capacity"),
        (lambda: PrefixStore(model, policy="lru"), "policy"),
        (lambda: PrefixStore(model, block_size=0), "block_size"),
        (lambda: PrefixStore(model, patch="no"), "patch"),
        (lambda: PrefixStore.default_for(model, capacity="1KB"), "default store"),
        (lambda: copy.deepcopy(store), "not copied"),
        (lambda: HybridPrefixCache(store, namespace=3), "namespace"),
        (lambda: HybridPrefixCache("store"), "PrefixStore"),
        (lambda: HybridPrefixCache(store, policy="dp"), "options of the store"),
        (lambda: prefixlab.patch("model"), "transformers model"),
        (lambda: prefixlab.patch(model, kernels="yes"), "kernels"),
        (lambda: prefixlab.unpatch("model"), "transformers model"),
        (lambda: store.flush(lookup="yes"), "lookup"),  # (a truthy string was read as True)
        (lambda: store.check_weights(serving="no"), "serving"),
    ]:
        refused(store, call, InvalidInputError, match)
    still_exact(served)


def forward(model, store, cache=None, **inputs):
    return lambda: model(past_key_values=cache or HybridPrefixCache(store), **inputs)


def test_forwards_with_malformed_inputs_raise_and_change_nothing(served):
    model, store = served[0], served[1]
    ids = PROMPTS[1][:, :10]
    for inputs, match in [
        ({"input_ids": ids[0]}, r"\[batch, length\]"),  # 1-D (was a raw ValueError from the hooks)
        ({"input_ids": ids[None]}, r"\[batch, length\]"),  # 3-D (transformers runs it on some models)
        ({"input_ids": ids[:, :0]}, r"\[batch, length>0\]"),
        ({"input_ids": ids + 1000}, "not a token id"),
        ({"input_ids": ids - 1000}, "not a token id"),
        ({"input_ids": ids.bool()}, "integer token ids"),
        ({"input_ids": ids.float()}, "integer token ids"),
        ({"inputs_embeds": torch.zeros(1, 10, model.config.hidden_size)}, "needs input_ids"),
        ({"input_ids": ids, "labels": ids}, "labels"),
    ]:
        refused(store, forward(model, store, **inputs), InvalidInputError, match)
    # what transformers itself refuses: its error, the store as it was
    refused(store, forward(model, store, input_ids=ids, position_ids=torch.arange(4)[None]), RuntimeError)
    still_exact(served)


def test_a_started_cache_given_another_request_refuses_it_and_changes_nothing(served):
    model, store = served[0], served[1]
    ids = PROMPTS[1][:, :10]
    for call, error, match in [
        (lambda c: generate(model, torch.cat([ids, ids]), c), InvalidInputError, "rows"),  # another batch size
        (lambda c: generate(model, PROMPTS[2][:, :9], c), InvalidInputError, "does not continue"),  # another prompt
        (lambda c: model(input_ids=PROMPTS[2][0, :9], past_key_values=c), InvalidInputError,
         r"\[batch, length\]"),  # 1-D (was a raw IndexError from the hooks)
        (lambda c: generate(model, PROMPTS[2][0, :9], c), IndexError, None),  # (generate's own refusal of 1-D ids)
    ]:
        cache = HybridPrefixCache(store)
        generate(model, ids, cache)  # a request held by the store, admitted at its next use (refused() flushes)
        refused(store, lambda c=cache, f=call: f(c), error, match)
    still_exact(served)


def test_a_started_caches_edits_refuse_bad_arguments_and_change_nothing(served):
    model, store = served[0], served[1]
    cache = HybridPrefixCache(store)
    generate(model, PROMPTS[1][:, :10], cache)
    held, length = cache.held_tokens().clone(), cache.get_seq_length()
    edits = [(lambda: cache.crop("a"), InvalidInputError), (lambda: cache.crop(-1.5), InvalidInputError)]
    if not store.layout.state_layers:  # transformers' own refusals of out-of-range rows (KV-only layers)
        edits += [(lambda: cache.reorder_cache(torch.tensor([5])), IndexError),
                  (lambda: cache.batch_select_indices(torch.tensor([5])), IndexError),
                  (lambda: cache.batch_repeat_interleave(-1), RuntimeError)]
    for call, error in edits:
        refused(store, call, error)
        assert torch.equal(cache.held_tokens(), held) and cache.get_seq_length() == length
    cache.reset()
    still_exact(served)


@pytest.mark.parametrize(("states", "message"), [("x", "states must be a dict"), ([(4, 1)], "states must be a dict"),
                                                 ({4: None}, r"states\[4\]")])
def test_the_core_refuses_states_that_are_not_a_dict_of_payloads(states, message):
    """PrefixCacheCore.admit read a list of pairs as a dict and failed in `dict` on a str (a raw ValueError)."""
    core = dp_core()
    match = core.match([1, 2, 3, 4])
    core.admit([1, 2, 3, 4, 5], lambda a, b: TokenKV(tuple(range(a, b))), {4: PrefixState((1, 2, 3, 4))}, match)
    core.release(match)
    before = tier(core, tensors=False)
    with pytest.raises(InvalidInputError, match=message):
        core.admit([1, 2, 3, 4, 6, 7], lambda a, b: TokenKV(tuple(range(a, b))), states)
    assert tier(core, tensors=False) == before


def test_clear_with_a_match_held_and_a_damaged_file_are_refused_and_change_nothing(served, tmp_path):
    model, store = served[0], served[1]
    held = store.match(PROMPTS[1][0].tolist())
    refused(store, store.clear, InvalidInputError, "between requests")
    store.release(held)
    damaged = tmp_path / "store.safetensors"
    store.save(damaged)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    refused(store, lambda: PrefixStore.load(damaged, model), PrefixlabError)  # (the open store's hooks stay)
    store.save(damaged)
    for options in ({"policy": "lru"}, {"offload_capacity": "lots"}, {"block_size": -1}, {"alpha": float("nan")}):
        refused(store, lambda o=options: PrefixStore.load(damaged, model, **o), InvalidInputError)
    other = build(served[4], seed=1)  # the same config, other weights: no hooks of this store
    refused(store, lambda: generate(other, PROMPTS[1][:, :10], HybridPrefixCache(store)), PrefixlabError)
    still_exact(served)


def test_masks_and_positions_transformers_accepts_run_exactly_and_store_nothing_new(served):
    """Masks that are not plain left padding (another length or batch, fractional, 3-D) are no error to transformers:
    the cache runs them uncached (`refused_input`, counted as a sequence) and admits nothing; odd positions reuse
    what they may. Either way the logits are the model's own for the same inputs."""
    model, store = served[0], served[1]
    ids = PROMPTS[1][:, :10]
    for extra in ({"attention_mask": torch.ones(1, 7, dtype=torch.long)}, {"attention_mask": torch.ones(2, 10)},
                  {"attention_mask": torch.full((1, 10), 0.5)}, {"attention_mask": torch.ones(1, 1, 10)},
                  {"cache_position": torch.arange(5, 15)}, {"position_ids": torch.arange(5, 15)[None]}):
        expected = model(input_ids=ids, **extra).logits
        store.flush()
        before = snapshot(store)["device"]["contents"]
        got = model(input_ids=ids, past_key_values=HybridPrefixCache(store), **extra).logits
        torch.testing.assert_close(got, expected[:, -got.shape[1]:], rtol=0, atol=1e-5)
        store.flush()
        if "attention_mask" in extra:
            assert snapshot(store)["device"]["contents"] == before
    still_exact(served)
