"""Helpers shared by the Hydragen generate() tests: seeded generation, exact comparison of outputs, refusals."""

import pytest
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


def assert_hydragen_refused(model, match: str) -> None:
    """`model` under attn_implementation="hydragen": HydragenCache refuses it (InvalidInputError matching `match`)
    and the fleet does not batch its siblings through one."""
    import prefixlab.attention  # noqa: F401  (registers attn_implementation="hydragen")
    from prefixlab.attention.hf_cache import HydragenCache
    from prefixlab.errors import InvalidInputError
    from prefixlab.fleet.siblings import batching_mode

    model.set_attn_implementation("hydragen")
    with pytest.raises(InvalidInputError, match=match):
        HydragenCache(model.config)
    assert batching_mode(model) is None
