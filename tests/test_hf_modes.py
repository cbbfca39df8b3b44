"""Training mode over a HybridPrefixCache: dropout active (in the model or some of its modules) and gradient
checkpointing are refused before anything is looked up or stored, on every forward of a request."""

import pytest
import torch
from hf_models import build, generate, tokens

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError


def test_a_model_with_active_dropout_is_refused_before_anything_is_looked_up_or_stored():
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 16, seed=12)
    model.train()  # the test configs' dropouts are 0: training mode alone changes nothing
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))
    before = store.stats()
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.1
    with pytest.raises(InvalidInputError, match=r"dropout active .*call model.eval\(\)"):
        generate(model, prompt, HybridPrefixCache(store))
    assert store.stats() == before
    model.eval()  # eval mode: dropout off whatever its rate
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))


def test_training_mode_is_checked_on_every_forward_and_gradient_checkpointing_refused():
    """A later turn continued on a started cache ran in training mode with dropout (only a request's first forward
    was checked) and admitted its random KV and states; with gradient checkpointing on, transformers' layers drop the
    cache, so the hooks loaded a prefix the forward then ignored (logits 0.24 off) and admitted an end state."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    prompt, cache = tokens(1, 16, seed=12), HybridPrefixCache(store)
    first = generate(model, prompt, cache)
    before = store.stats()
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    model.train()
    attention.attention_dropout = 0.1
    with pytest.raises(InvalidInputError, match="dropout active"):
        generate(model, torch.cat([first, tokens(1, 6, seed=13)], 1), cache)  # the next turn, on the started cache
    attention.attention_dropout = 0.0
    model.gradient_checkpointing_enable()
    with pytest.raises(InvalidInputError, match=r"gradient checkpointing on.*model.eval\(\)"):
        generate(model, prompt, HybridPrefixCache(store))
    after = store.stats()
    assert all(after[key] == before[key] for key in ("hit_sequences", "used_bytes", "checkpoints", "nodes"))
    model.eval()  # gradient checkpointing does nothing outside training mode
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))


def test_submodules_in_training_mode_are_refused_in_an_eval_model(tmp_path):
    """Only `model.training` was read: Monte-Carlo dropout (`model.eval()`, then some modules `.train()`) stored
    random KV that later eval requests reused (logits up to 0.57 off); decoder layers training with gradient
    checkpointing dropped the cache the hooks had loaded (0.73 off)."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 16, seed=12)
    generate(model, prompt, HybridPrefixCache(store))
    before = store.stats()
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    attention.train()
    attention.attention_dropout = 0.1
    with pytest.raises(InvalidInputError, match="some of its modules.*dropout active"):
        generate(model, prompt, HybridPrefixCache(store))
    attention.attention_dropout = 0.0
    model.gradient_checkpointing_enable()
    for layer in model.model.layers:
        layer.train()
    with pytest.raises(InvalidInputError, match="some of its modules.*gradient checkpointing on"):
        generate(model, prompt, HybridPrefixCache(store))
    after = store.stats()
    assert all(after[key] == before[key] for key in ("hit_sequences", "used_bytes", "checkpoints", "nodes"))
    model.train()
    store.save(tmp_path / "store.safetensors")  # a checkpoint inside a training script: saving computes nothing
    model.eval()
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))


def test_moe_jitter_noise_in_training_mode_is_refused_like_dropout():
    """MiniMax / Mixtral / PhiMoE routers multiply their input by random noise in training mode (router_jitter_noise):
    only dropout was checked, so a training-mode request stored random KV and states that later eval requests reused
    (no dropout module, no attention_dropout: accepted)."""
    model = build("minimax")
    store = PrefixStore(model, capacity="64MB")
    prompt = tokens(1, 16, seed=12)
    blocks = [m for m in model.modules() if hasattr(m, "jitter_noise")]
    assert blocks
    model.train()
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))  # jitter 0
    before = store.stats()
    for block in blocks:
        block.jitter_noise = 0.5
    with pytest.raises(InvalidInputError, match=r"jitter_noise.*call model.eval\(\)"):
        generate(model, tokens(1, 16, seed=13), HybridPrefixCache(store))
    after = store.stats()
    assert all(after[key] == before[key] for key in ("hit_sequences", "used_bytes", "checkpoints", "nodes"))
    model.eval()  # eval mode: no noise whatever its rate
    assert torch.equal(generate(model, prompt, HybridPrefixCache(store)), generate(model, prompt))
