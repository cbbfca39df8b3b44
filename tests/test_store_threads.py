"""One PrefixStore shared by threads running generate() at once, under a budget tight enough that admissions evict:
outputs equal the uncached model's, the store stays consistent, close() leaves the model as it was."""

import sys
import threading
import warnings

import pytest
import torch
from hf_models import build

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


def serve_concurrently(model, store, prompts) -> tuple[dict, list]:
    """Every prompt served once, split over THREADS threads started together; (outputs by index, errors)."""
    outputs, errors, start = {}, [], threading.Barrier(THREADS)

    def worker(first):
        start.wait()
        for i in range(first, len(prompts), THREADS):
            try:
                outputs[i] = model.generate(prompts[i], past_key_values=HybridPrefixCache(store), **GREEDY)
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
], ids=["patched", "split+offload"])
def test_threads_sharing_an_evicting_store_get_exact_outputs(workload, options):
    model, prompts, expected = workload
    store = PrefixStore(model, capacity=160 * 1024, block_size=4, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tight budget refuses some entries: they run uncached
        for _ in range(2):  # the second round starts from a full store
            outputs, errors = serve_concurrently(model, store, prompts)
            assert errors == []
            assert [i for i in range(len(prompts)) if not torch.equal(outputs[i], expected[i])] == []
        stats = store.stats()
    store.core.check_invariants()
    if store.offload is not None:
        store.offload.check_invariants()
    assert stats["locked_matches"] == 0 and stats["used_bytes"] <= store.capacity_bytes
    assert stats["evictions"] > 0 and stats["hit_sequences"] > 0  # the stress did evict and reuse
    store.close()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not is_patched(model) and "forward" not in vars(model)
