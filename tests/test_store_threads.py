"""One PrefixStore shared by threads running generate() at once, under a budget tight enough that admissions evict:
outputs equal the uncached model's, the store stays consistent, close() leaves the model as it was."""

import sys
import threading
import time
import warnings

import pytest
import torch
from hf_models import build

import prefixlab
from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.recurrent.patch import is_patched

THREADS = 4
GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


def tokens(length, seed):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def workload():
    """A tiny hybrid, 24 prompts over 3 shared prefixes (cut at different depths, own tails) and their outputs
    without prefixlab, computed one at a time before any thread starts."""
    model = build("qwen3_5")
    bases = [tokens(24, seed) for seed in range(3)]
    prompts = [torch.cat([bases[i % 3][:, : 8 + (i * 5) % 17], tokens(1 + i % 4, 100 + i)], dim=1) for i in range(24)]
    return model, prompts, [model.generate(prompt, **GREEDY) for prompt in prompts]


def serve_concurrently(model, store, prompts, chunk=None) -> tuple[dict, list]:
    """Every prompt served once, split over THREADS threads started together (every other one in prefill chunks of
    `chunk` tokens, if given); (outputs by index, errors)."""
    outputs, errors, start = {}, [], threading.Barrier(THREADS)

    def worker(first):
        start.wait()
        for i in range(first, len(prompts), THREADS):
            try:
                chunked = {"prefill_chunk_size": chunk} if chunk and i % 2 else {}
                outputs[i] = model.generate(prompts[i], past_key_values=HybridPrefixCache(store), **GREEDY, **chunked)
            except Exception as err:  # reported below: the test fails on any
                errors.append(f"request {i}: {err!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleavings that corrupt an unlocked store
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    return outputs, errors


@pytest.mark.parametrize("options", [
    dict(policy="marconi"),  # patched layers: states captured inside the one prefill
    dict(policy="dp", patch=False, offload_capacity=256 * 1024),  # split prefills, evictions move to the host tier
    dict(policy="dp", chunk=5),  # chunked prefills resume at every chunk while other threads admit and evict
], ids=["patched", "split+offload", "chunked"])
def test_threads_sharing_an_evicting_store_get_exact_outputs(workload, options):
    model, prompts, expected = workload
    options = dict(options)
    chunk = options.pop("chunk", None)
    store = PrefixStore(model, capacity=160 * 1024, block_size=4, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tight budget refuses some entries: they run uncached
        # the second round starts from a full store; more rounds only while no request has resumed yet (how often
        # one does depends on the threads' interleaving: a whole-suite run under forced AVX2 code once saw none in two)
        for round_ in range(6):
            outputs, errors = serve_concurrently(model, store, prompts, chunk)
            assert errors == []
            assert [i for i in range(len(prompts)) if not torch.equal(outputs[i], expected[i])] == []
            stats = store.stats()
            if round_ >= 1 and stats["hit_sequences"] > 0:
                break
    store.core.check_invariants()
    if store.offload is not None:
        store.offload.check_invariants()
    assert stats["locked_matches"] == 0 and stats["used_bytes"] <= store.capacity_bytes
    assert stats["evictions"] > 0 and stats["hit_sequences"] > 0  # the stress did evict and reuse
    store.close()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not is_patched(model) and "forward" not in vars(model)


def test_threads_binding_unbound_caches_at_once_share_one_default_store(monkeypatch):
    """`HybridPrefixCache(policy="dp")` in two threads on one patched model: both bind to one default store (created
    once, however the threads interleave) and both outputs are exact."""
    from prefixlab.cache import store as store_module
    from prefixlab.cache.defaults import default_store

    model = prefixlab.patch(build("qwen3_5"))
    prompts = [tokens(12, seed) for seed in (40, 41)]
    expected = [model.generate(prompt, **GREEDY) for prompt in prompts]
    identity = store_module.model_identity

    def slow_identity(model):  # widen the window in which an unlocked lookup-or-create builds two stores
        time.sleep(0.05)
        return identity(model)

    monkeypatch.setattr(store_module, "model_identity", slow_identity)
    caches = [HybridPrefixCache(policy="dp", capacity="64MB", block_size=4) for _ in prompts]
    outputs, errors, start = [None] * len(prompts), [], threading.Barrier(len(prompts))

    def worker(i):
        start.wait()
        try:
            outputs[i] = model.generate(prompts[i], past_key_values=caches[i], **GREEDY)
        except Exception as err:  # reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert caches[0].store is caches[1].store is default_store(model)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected, strict=True))
    prefixlab.unpatch(model)
    assert caches[0].store.closed and not model._forward_hooks and not is_patched(model)


def test_one_cache_in_two_threads_refuses_the_second_generate():
    """Two threads generating over one cache (the README says not to) could give a silently wrong output: one
    thread's failure reset the cache under the other's request, whose next decode step then began a new one."""
    from prefixlab.errors import InvalidInputError

    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    cache, inside, refused = HybridPrefixCache(store), threading.Event(), threading.Event()
    prompt = tokens(16, 3)

    def wait_for_the_other(input_ids, scores):  # (a logits processor: runs inside the first thread's generate)
        inside.set()
        refused.wait(timeout=60)
        return scores

    outputs = {}
    first = threading.Thread(target=lambda: outputs.setdefault("first", model.generate(
        prompt, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
        logits_processor=[wait_for_the_other])))
    first.start()
    assert inside.wait(timeout=60)
    try:
        with pytest.raises(InvalidInputError, match="in use by a generate"):
            model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        refused.set()
        first.join()
    assert torch.equal(outputs["first"], model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("call", ["lookup", "stats"])
def test_lookups_during_a_generate_store_nothing_of_its_decode_steps(call):
    """Every other request's lookup committed the requests still decoding: a state per lookup per decoding request
    (27 along one 200-token generation, 0.8 ms per open request per lookup; here 10 states against 3); so did
    store.stats() (a monitor polling it at each streamed token: 69 states against 7). Its prompt is admitted at the
    first lookup; its decode steps when the call returns."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, prompt = build("qwen3_5"), tokens(20, 7)

    class Lookups(LogitsProcessor):  # what another request arriving every few decode steps does to the store
        def __init__(self, store):
            self.store, self.steps = store, 0

        def __call__(self, input_ids, scores):
            self.steps += 1
            if self.steps % 3 == 0 and call == "lookup":
                self.store.release(self.store.match(tokens(8, self.steps).flatten().tolist()))
            elif self.steps % 3 == 0:
                self.store.stats()
            return scores

    states, outputs = [], []
    for lookups in (False, True):
        store = PrefixStore(model, capacity="64MB", policy="marconi")
        processors = LogitsProcessorList([Lookups(store)] if lookups else [])
        outputs.append(model.generate(prompt, past_key_values=HybridPrefixCache(store), max_new_tokens=24,
                                      do_sample=False, pad_token_id=0, logits_processor=processors))
        store.flush()
        states.append(store.stats()["checkpoints"])
        store.close()
    # (+1: the state where the request stood at the first lookup, which admits its prompt)
    assert torch.equal(outputs[0], outputs[1]) and states[1] <= states[0] + 1


@pytest.mark.parametrize("chunk", [None, 1])
def test_a_lookup_during_a_later_generate_finds_that_calls_prompt(chunk):
    """The decode steps a lookup leaves are those of the generate() call running: a conversation's next call on the
    same cache (or a prompt fed one token at a time) still has its prompt admitted at the first lookup."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = build("llama" if chunk else "qwen3_5")  # (one-token prefill chunks: an attention-only model)
    store, reused = PrefixStore(model, capacity="64MB", policy="marconi"), []

    class Lookup(LogitsProcessor):  # another request extending this call's prompt arrives while it decodes
        def __init__(self, prompt):
            self.prompt, self.steps = prompt, 0

        def __call__(self, input_ids, scores):
            self.steps += 1
            if self.steps == 3:
                match = store.match([*self.prompt[0].tolist(), 5, 6, 7])
                reused.append(match.length)
                store.release(match)
            return scores

    cache, prompt = HybridPrefixCache(store), tokens(24, 8)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    for turn in range(2):
        out = model.generate(prompt, past_key_values=cache, logits_processor=LogitsProcessorList([Lookup(prompt)]),
                             **options)
        assert torch.equal(out, model.generate(prompt, **options))
        prompt = torch.cat([out, tokens(20, 9 + turn)], dim=1)
    assert reused[0] >= 23 and reused[1] >= 24 + 6 + 20 - 1, reused
