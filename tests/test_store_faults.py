"""PrefixStore under faults: a bad row in a batch, an interrupt mid-generate, two stores on one model, a closed
store. Each leaves the store consistent (nothing locked, nothing half admitted) and the next request exact."""

import pytest
import torch
from hf_models import build
from prefix_helpers import node_paths
from transformers import LogitsProcessor, LogitsProcessorList

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError, StoreClosedError
from prefixlab.recurrent.patch import is_patched

GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


def tokens(*shape, seed=0):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


def generate(model, prompt, cache=None):
    return model.generate(prompt, past_key_values=cache, **GREEDY)


def entries(store) -> tuple:
    """What the store holds (paths, checkpoints, bytes), not its request counters."""
    return sorted((path, tuple(node.ckpt_pos)) for node, path in node_paths(store.core)), store.core.used_bytes


@pytest.mark.parametrize("bad_id", [-1, 128])  # negative; past the vocabulary (128 in the tiny configs)
def test_a_bad_row_in_a_batch_raises_and_locks_nothing(model, bad_id):
    store = PrefixStore(model, capacity=48 * 1024, policy="marconi", block_size=4)
    first, other = tokens(1, 20, seed=1), tokens(1, 20, seed=2)
    generate(model, first, HybridPrefixCache(store))
    store.flush()
    before = entries(store)
    batch = torch.cat([first, other])
    batch[1, 7] = bad_id
    cache = HybridPrefixCache(store)
    with pytest.raises(InvalidInputError, match="token id"):
        generate(model, batch, cache)
    assert store.stats()["locked_matches"] == 0 and entries(store) == before
    store.core.check_invariants()
    # nothing stays locked: the tight budget evicts the first entry to admit another one
    generate(model, other, cache)  # the same cache object serves a fresh request
    store.flush()
    assert store.core.match(other[0].tolist()).length > 0
    store.close()


def test_float_token_ids_are_refused_before_anything_is_looked_up_or_admitted(model):
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    generate(model, tokens(1, 20, seed=1), HybridPrefixCache(store))  # held by the store, admitted at its next use
    before = entries(store)
    with pytest.raises(InvalidInputError, match="integer token ids.*long"):
        generate(model, tokens(1, 20, seed=2).float(), HybridPrefixCache(store))
    assert entries(store) == before and store.stats()["locked_matches"] == 0
    store.close()


def test_a_request_whose_first_forward_the_model_refuses_is_not_counted(model):
    """position_ids of another length: the store refuses them as not plain (runs uncached), then the model raises;
    before, stats() counted a refused_input sequence for a request that never ran."""
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 20, seed=3)
    generate(model, prompt, HybridPrefixCache(store))
    before = store.stats()
    with pytest.raises(RuntimeError):
        model(input_ids=prompt, position_ids=torch.arange(25)[None], past_key_values=HybridPrefixCache(store))
    assert store.stats() == before
    store.close()


class Interrupt:
    """A forward pre-hook on one layer raising KeyboardInterrupt on its `at`-th call."""

    def __init__(self, model, at: int):
        self.calls, self.at = 0, at
        self.handle = model.model.layers[1].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("patch", [True, False], ids=["patched", "split-prefill"])
@pytest.mark.parametrize("at", [1, 3], ids=["mid-prefill", "mid-decode"])
def test_keyboard_interrupt_resets_the_cache_and_leaves_the_store_unchanged(model, patch, at):
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=patch)
    first = tokens(1, 16, seed=3)
    second = torch.cat([first, tokens(1, 6, seed=4)], dim=1)  # a follow-up: resumes where `first` ended
    generate(model, first, HybridPrefixCache(store))
    store.flush()
    before, expected = entries(store), generate(model, second)
    cache = HybridPrefixCache(store)
    interrupt = Interrupt(model, at)
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(model, second, cache)
    finally:
        interrupt.handle.remove()
    assert not cache.started and cache.get_seq_length() == 0
    assert store.stats()["locked_matches"] == 0 and entries(store) == before
    store.core.check_invariants()
    assert torch.equal(generate(model, second, cache), expected)  # the same object serves the request again
    assert cache.reused_tokens > 0
    store.close()
    assert "forward" not in vars(model) and not model._forward_hooks


class InterruptBetweenForwards(LogitsProcessor):
    """A logits processor raising KeyboardInterrupt on its `at`-th call: between two forwards, where the forward
    guard does not see it (as a stopping criterion or a streamer could)."""

    def __init__(self, at: int):
        self.calls, self.at = 0, at

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return scores


def test_an_interrupt_between_forwards_resets_the_cache_and_leaves_the_store_unchanged(model):
    """Before, the cache stayed started (18 tokens) and the store admitted the interrupted request at its next use;
    the same cache then refused the request as not continuing it."""
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    first = tokens(1, 12, seed=3)
    second = torch.cat([first, tokens(1, 5, seed=4)], dim=1)
    generate(model, first, HybridPrefixCache(store))
    store.flush()
    before, expected = entries(store), generate(model, second)
    cache = HybridPrefixCache(store)
    with pytest.raises(KeyboardInterrupt):
        model.generate(second, past_key_values=cache, logits_processor=LogitsProcessorList(
            [InterruptBetweenForwards(2)]), **GREEDY)
    assert not cache.started and cache.get_seq_length() == 0
    store.flush()
    assert store.stats()["locked_matches"] == 0 and entries(store) == before
    assert torch.equal(generate(model, second, cache), expected)  # the same object serves the request again
    # generate refusing its arguments before any forward keeps what the cache held: the chat can go on
    with pytest.raises(ValueError):
        model.generate(torch.cat([expected, tokens(1, 3, seed=5)], dim=1), past_key_values=cache,
                       max_new_tokens=-1)
    assert cache.started
    store.close()


@pytest.mark.parametrize("bad_id", [-1, 128])
def test_a_later_turn_with_a_bad_token_id_is_refused_before_the_store_is_asked(model, bad_id):
    """A chat turn continued on the same cache: an id past the vocabulary raised torch's IndexError after the store
    had been looked up (its request count and recency changed)."""
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 12, seed=6)
    cache = HybridPrefixCache(store)
    turn = generate(model, prompt, cache)
    store.flush()
    before, stats = entries(store), store.stats()
    follow_up = torch.cat([turn, tokens(1, 4, seed=7)], dim=1)
    follow_up[0, -2] = bad_id
    with pytest.raises(InvalidInputError, match="not a token id"):
        generate(model, follow_up, cache)
    assert entries(store) == before and store.stats() == stats
    store.close()


def test_a_new_prompt_on_a_used_mamba2_cache_is_refused():
    """Mamba2's generate feeds its whole input over cache_params, and no positions tell the hooks a new prompt from
    a continued one: a new prompt ran on the old request's state (wrong logits, shorter prompts wrong tokens).
    generate() now refuses an input that does not start with the held tokens, as for the other families."""
    mamba = build("mamba2")
    store = PrefixStore(mamba, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 10, seed=8)
    for other in (tokens(1, 6, seed=9), tokens(1, 10, seed=10), tokens(1, 20, seed=11)):
        cache = HybridPrefixCache(store)
        turn = mamba.generate(prompt, cache_params=cache, **GREEDY)
        with pytest.raises(InvalidInputError, match="does not continue them"):
            mamba.generate(other, cache_params=cache, **GREEDY)
        assert not cache.started
    # a continued chat is still served, exactly
    cache = HybridPrefixCache(store)
    turn = mamba.generate(prompt, cache_params=cache, **GREEDY)
    follow_up = torch.cat([turn, tokens(1, 5, seed=12)], dim=1)
    assert torch.equal(mamba.generate(follow_up, cache_params=cache, **GREEDY), mamba.generate(follow_up, **GREEDY))
    store.close()


def test_closing_one_of_two_stores_keeps_the_model_patched_for_the_other():
    """Jamba resumes exactly only patched: the patch is shared, the last store closed unpatches."""
    model = build("jamba")
    prompt = tokens(1, 20, seed=6)
    expected = generate(model, prompt)  # transformers without prefixlab
    first = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    second = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    third = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=False)  # rides on the patch
    first.close()
    second.close()
    assert is_patched(model) and third.records_in_kernel
    for turn in range(2):
        cache = HybridPrefixCache(third)
        assert torch.equal(generate(model, prompt, cache), expected)
        assert cache.reused_tokens == (19 if turn else 0)
    third.close()
    assert not is_patched(model) and not model._forward_hooks and not model._forward_pre_hooks


def test_a_closed_store_refuses_every_use_with_a_clear_error(model, tmp_path):
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 12, seed=7)
    generate(model, prompt, HybridPrefixCache(store))
    match = store.core.match(prompt[0].tolist())
    built_before = HybridPrefixCache(store)
    store.close()
    store.close()  # idempotent
    uses = [
        lambda: store.match([1, 2]), lambda: store.lookup([1, 2]), lambda: store.plan([1, 2], match),
        lambda: store.release(match), lambda: store.admit([1, 2], lambda a, b: None, {}), lambda: store.flush(),
        lambda: store.stats(), lambda: store.save(tmp_path / "s.safetensors"), lambda: store.record_request([]),
        lambda: HybridPrefixCache(store), lambda: generate(model, prompt, built_before), built_before.get_seq_length,
    ]
    for use in uses:
        with pytest.raises(StoreClosedError, match="was closed.*Build a new PrefixStore"):
            use()
    assert not (tmp_path / "s.safetensors").exists()
    default = PrefixStore.default_for(model)
    default.close()
    fresh = PrefixStore.default_for(model)  # the closed default is replaced, not handed out
    assert fresh is not default and not fresh.closed
    fresh.close()


def test_a_forward_that_died_unseen_is_refused_once_then_the_cache_serves_again(model, monkeypatch):
    """An interrupt landing between the store's hooks and its forward guard leaves the cache mid-forward: its next
    use raises (generate was told a stale length) and resets it."""
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt, cache = tokens(1, 12, seed=8), HybridPrefixCache(store)
    expected = generate(model, prompt)
    monkeypatch.setattr(cache, "forward_failed", lambda: None)  # nothing sees the interrupt
    interrupt = Interrupt(model, 2)
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(model, prompt, cache)
    finally:
        interrupt.handle.remove()
        monkeypatch.undo()
    assert cache.in_flight
    with pytest.raises(InvalidInputError, match="previous forward was interrupted"):
        generate(model, prompt, cache)
    assert not cache.started and store.stats()["locked_matches"] == 0
    assert torch.equal(generate(model, prompt, cache), expected)
    store.close()


def test_a_used_cache_over_a_closed_store_is_refused_not_run_on_its_old_states(model):
    """Closing the store takes the hooks off the model: a cache that served a request must not then take another
    forward (nothing would cut or check its tokens: they would run on the old request's states)."""
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    prompt = tokens(1, 12, seed=8)
    cache = HybridPrefixCache(store)
    generate(model, prompt, cache)
    store.close()
    with pytest.raises(StoreClosedError, match="was closed.*Build a new PrefixStore"):
        generate(model, prompt, cache)
    with pytest.raises(StoreClosedError, match="was closed"):
        model(input_ids=prompt, past_key_values=cache)


def test_an_unknown_option_is_refused_before_the_model_is_touched(model, tmp_path):
    """It reached PrefixCacheCore as a bare TypeError (from PrefixStore.load too, after the file was read)."""
    with pytest.raises(InvalidInputError, match="no option foo; it takes capacity"):
        PrefixStore(model, capacity="64MB", foo=1)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    generate(model, tokens(1, 20, seed=4), HybridPrefixCache(store))
    store.save(tmp_path / "store.safetensors")
    store.close()
    with pytest.raises(InvalidInputError, match="no option foo"):
        PrefixStore.load(tmp_path / "store.safetensors", model, foo=1)
    assert not getattr(model, "prefixlab_patched", False) and not model._forward_pre_hooks


def test_admit_refuses_payloads_that_do_not_fit_the_model(model):
    """PrefixStore.admit took an empty state (a later request then resumed from nothing: other tokens), KV of other
    layers or dtype (a later request failed inside torch) and stored them."""
    from prefixlab.cache.tensors import TensorKV, TensorState

    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    generate(model, tokens(1, 20, seed=10), HybridPrefixCache(store))
    store.flush()
    before, layers = entries(store), store.layout.kv_layers
    prompt = tokens(1, 30, seed=11)[0].numpy()

    def kv(dtype=torch.float32, kv_layers=layers):
        return lambda a, b: TensorKV(b - a, {i: torch.zeros(2, b - a, 16, dtype=dtype) for i in kv_layers},
                                     {i: torch.zeros(2, b - a, 16, dtype=dtype) for i in kv_layers})

    good_state = store.core.match(tokens(1, 20, seed=10)[0].numpy())
    state = good_state.state
    store.core.release(good_state)
    for bad_kv, states, match in ((kv(), {29: TensorState({}, {})}, "a conv state for each recurrent layer"),
                                  (kv(), {29: TensorState(state.conv, {})}, "a recurrent state for"),
                                  (kv(), {29: "state"}, "must be a TensorState"),
                                  (kv(torch.float64), {29: state}, "dtype"),
                                  (kv(kv_layers=(99,)), {29: state}, "attention layers")):
        with pytest.raises(InvalidInputError, match=match):
            store.admit(prompt, bad_kv, states)
        assert entries(store) == before
    store.close()


def test_a_store_over_a_model_whose_needed_patch_was_taken_off_refuses_requests():
    """A Jamba store built inside `with patched(model):` went on after the block unpatched the model: its hits ran
    transformers' Mamba layers, which restart a multi-token scan from zeros (logits off by 2e-5, no error)."""
    from prefixlab.errors import UnsupportedModelError
    from prefixlab.recurrent import patched

    jamba = build("jamba")
    with patched(jamba):
        store = PrefixStore(jamba, capacity="64MB", policy="marconi", block_size=4)
    assert not is_patched(jamba)
    with pytest.raises(UnsupportedModelError, match="patch was taken off"):
        generate(jamba, tokens(1, 12, seed=12), HybridPrefixCache(store))
    store.close()


def test_a_store_collected_without_close_gives_its_hooks_and_patch_back(model):
    """A store dropped without close() left the model hooked and patched for good (copy.deepcopy(model) then failed,
    naming stores that no longer existed)."""
    import copy
    import gc

    from prefixlab.cache.hooks import is_attached

    first, second = PrefixStore(model, capacity="1MB"), PrefixStore(model, capacity="1MB")
    del second
    gc.collect()
    first.close()
    assert not is_attached(model) and not getattr(model, "prefixlab_patched", False)
    copy.deepcopy(model)


def test_a_plain_forward_after_a_store_was_collected_runs_the_unpatched_model(model):
    """The queue of collected stores was drained only at prefixlab's next call: the model kept its hooks and patch
    (its logits not the unpatched model's bits, deepcopy refused) until then. A plain forward drains it first."""
    import copy
    import gc

    from prefixlab.cache.hooks import is_attached

    ids = tokens(1, 12, seed=5)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    store = PrefixStore(model, capacity="1MB")
    generate(model, ids, HybridPrefixCache(store))
    del store
    gc.collect()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)
    assert not is_attached(model) and not getattr(model, "prefixlab_patched", False)
    copy.deepcopy(model)


def test_collecting_a_store_takes_no_lock(model):
    """The collector runs a finalizer wherever the collecting thread is, e.g. inside the patch's hold() with its lock
    held (building another store): a finalizer that gave the patch back there deadlocked (the suite hung)."""
    import gc
    import importlib
    import threading

    patch = importlib.import_module("prefixlab.recurrent.patch")  # (the package's `patch` is the function)
    first, second = PrefixStore(model, capacity="1MB"), PrefixStore(model, capacity="1MB")
    second.cycle = second  # (only the collector frees it)
    del second
    collector = threading.Thread(target=gc.collect, daemon=True)
    with patch._OWNERS_LOCK:  # (held, as hold() holds it)
        collector.start()
        collector.join(timeout=10)
        assert not collector.is_alive()
    first.close()  # gives back what the collected store held, too
    assert not getattr(model, "prefixlab_patched", False)


def test_closing_the_default_store_makes_the_next_open_store_the_default(model):
    """After the default store closed, an unbound cache built a new 4 GB store beside the model's open one."""
    first, second = PrefixStore(model, capacity="16MB"), PrefixStore(model, capacity="8MB")
    prompt = tokens(1, 12, seed=3)
    generate(model, prompt, HybridPrefixCache(second))
    first.close()
    cache = HybridPrefixCache()
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt))
    assert cache.store is second and cache.reused_tokens == 11 and PrefixStore.default_for(model) is second
    second.close()

