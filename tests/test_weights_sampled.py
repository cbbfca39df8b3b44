"""Parameters made under torch.inference_mode (no version counter) and buffers count by a sample of 64 of their values
(weights.py): an in-place write that misses every sampled element goes unseen, and the store serves entries of the
old weights. Unfixed (a check of every value costs a read of the whole model per request): README says to call
store.clear() after such writes."""

import warnings

import pytest
import torch
from hf_models import FAMILIES, config, generate, tokens

from prefixlab import HybridPrefixCache, PrefixStore


@pytest.mark.xfail(strict=True, reason="inference-mode parameters are compared by 64 sampled values: a one-row write "
                   "into the embedding is not seen and 19 cached tokens of the old weights are reused")
def test_a_one_row_write_into_an_inference_mode_embedding_empties_the_store():
    with torch.inference_mode():
        torch.manual_seed(0)
        model = FAMILIES["qwen3_5"][1](config("qwen3_5")).eval()
        store = PrefixStore(model, capacity="64MB", block_size=4)
        prompt = tokens(1, 20, seed=1)
        generate(model, prompt, HybridPrefixCache(store))
        model.model.embed_tokens.weight[int(prompt[0, 3])] += 5.0  # (a retrained token's row, say)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = generate(model, prompt, HybridPrefixCache(store), output_logits=True, return_dict_in_generate=True)
        reused = store.stats()["reused_tokens"]
        ref = generate(model, prompt, output_logits=True, return_dict_in_generate=True)
    store.close()
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits, strict=True)) <= 1e-5
    assert reused == 0
