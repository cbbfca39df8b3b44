"""The numeric contract (README "Numerics"): what is bit-identical and what only within tolerance.

Bit-identical (torch.equal, same device, dtype and batch): a request that reuses nothing is exactly the same model
without prefixlab (patched kernels record states inside the pass without changing it; transformers' layers run
unsplit when no capture is planned). Within tolerance: a request that reuses a prefix runs only the rest, a shorter
forward, which kernels may round differently (chunked scans restart their chunks, a one-row GEMM rounds unlike the
same row inside a larger one), so it is compared with transformers' one forward within a stated tolerance.
`PREFIXLAB_TEST_DEVICE=cuda` runs it on a GPU (with fla installed, bf16 GatedDeltaNet layers run fla's kernels).
"""

import pytest
import torch
from hf_models import TEST_DEVICE, build, cache_argument

from prefixlab.cache.hf import HybridPrefixCache
from prefixlab.cache.store import PrefixStore
from prefixlab.recurrent.patch import patch as patch_model

# logits of the served request vs transformers' one forward over the same tokens (teacher forced)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
FAMILIES = ["qwen3_5", "bamba"]


def served(model, input_ids, cache=None):
    extra = {cache_argument(model): cache} if cache is not None else {}
    return model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True, **extra)


def prompts(count: int):
    """Prompts sharing a 24-token system prompt (the third and later reuse it), then a repeat of the first."""
    rng = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (1, 24), generator=rng)
    asked = [torch.cat([system, torch.randint(3, 128, (1, 5 + i), generator=rng)], dim=1) for i in range(count)]
    return [prompt.to(TEST_DEVICE) for prompt in asked + [asked[0]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "transformers-layers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_that_reuses_nothing_is_the_model_bit_for_bit(family, patched, dtype):
    """First-time prompts through the store (captures planned at their last token and at branch points of later
    ones) give the very logits of the same model without prefixlab; patched layers capture inside the pass, and
    transformers' layers run the prefill unsplit when nothing is planned inside it."""
    model = build(family).to(TEST_DEVICE, dtype)
    model = patch_model(model) if patched else model
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=False)
    for prompt in prompts(2):  # two new prompts: neither reuses anything, the second plans its branch point
        cache = HybridPrefixCache(store)
        got, expected = served(model, prompt, cache), served(model, prompt)
        if cache.reused_tokens or (not patched and store.stats()["sequences"] > 1):
            break  # the repeat reuses; transformers' layers split the second prompt at its branch point
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))


def teacher_forced_logits(model, sequence: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits at every position of `sequence` after the reused prefix (one forward, no sampling)."""
    extra = {cache_argument(model): cache} if cache is not None else {}
    with torch.no_grad():
        return model(input_ids=sequence, **extra).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "transformers-layers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_that_reuses_a_prefix_is_within_tolerance_of_transformers(family, patched, dtype):
    """Reused requests against transformers' own model and one forward over the whole sequence (no prefixlab, no
    patch): fp32 within 1e-5, bf16 within the stated tolerance; the store never hands out other bits than it
    captured, so this holds for every later request."""
    reference = build(family).to(TEST_DEVICE, dtype)
    model = build(family).to(TEST_DEVICE, dtype)
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4, patch=patched)
    reused = []
    for prompt in prompts(3):
        cache = HybridPrefixCache(store)
        got = teacher_forced_logits(model, prompt, cache)
        expected = teacher_forced_logits(reference, prompt)[:, cache.reused_tokens:]
        got_last = got.shape[1]  # with transformers' layers a split prefill returns its last segment's logits
        expected = expected[:, expected.shape[1] - got_last:]
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        reused.append(cache.reused_tokens)
    assert reused[2] >= 24
