"""A patched model under PrefixStore: states are recorded inside one forward, reuse stays exact."""

from __future__ import annotations

import pytest
import torch
from recurrent_patch_models import build, tokens

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore
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
