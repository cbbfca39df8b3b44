"""Helpers shared by the Hydragen generate() tests: seeded generation, exact comparison of outputs, refusals."""

import pytest
import torch
from transformers import DynamicCache

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


def prefix_tensors(model, prefix):
    """What a prefix store hands over: per-layer KV and recurrent states after `prefix`, computed by `model`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, past_key_values=cache, use_cache=True)
    attention = {i: layer for i, layer in enumerate(cache.layers) if getattr(layer, "keys", None) is not None}
    recurrent = {i: layer for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")}
    return dict(
        keys={i: layer.keys for i, layer in attention.items()},
        values={i: layer.values for i, layer in attention.items()},
        conv_states={i: layer.conv_states[0] for i, layer in recurrent.items()},
        recurrent_states={i: layer.recurrent_states[0] for i, layer in recurrent.items()
                          if layer.is_recurrent_states_initialized[0]},  # (none in LFM2's conv layers)
    )
