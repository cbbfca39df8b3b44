"""Helpers shared by the Hydragen generate() tests: seeded generation and exact comparison of outputs."""

import torch

GEN = dict(return_dict_in_generate=True, output_scores=True, pad_token_id=0)


def generate_seeded(model, ids, seed, cache=None, *, max_new_tokens, **kwargs):
    """`model.generate` after seeding torch, so sampled runs are comparable."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=max_new_tokens, **GEN, **kwargs)


def assert_same(ref, out):
    """Identical tokens and scores within 1e-5 (fp32)."""
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
