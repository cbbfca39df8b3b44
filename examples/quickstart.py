"""Exact cross-request prefix reuse on a tiny random-init Qwen3.5-architecture hybrid (runs on CPU in seconds)."""

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import prefixlab
from prefixlab import HybridPrefixCache
from prefixlab.cache.explain import format_reasons

config = Qwen3_5TextConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],  # 3:1 GatedDeltaNet : attention
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, pad_token_id=0, eos_token_id=None,
)
torch.manual_seed(0)
model = Qwen3_5ForCausalLM(config).eval()
plain = {}  # outputs without prefixlab, to compare with
system = torch.randint(1, 1000, (1, 300))
questions = [torch.cat([system, torch.randint(1, 1000, (1, 20))], dim=1) for _ in range(3)]
for i, input_ids in enumerate(questions):
    plain[i] = model.generate(input_ids, max_new_tokens=16, do_sample=False)

prefixlab.patch(model)  # once per model: prefixlab's kernels + the hooks every HybridPrefixCache works through
for i, input_ids in enumerate(questions):
    cache = HybridPrefixCache(policy="dp", capacity="256MB")  # README's line: binds to the model's default store
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, plain[i]), "prefix reuse changed the output"
    print(f"request {i}: identical tokens; {cache.report()}")
stats = cache.store.stats()
print({k: v for k, v in stats.items() if k in ("hit_sequences", "reused_tokens", "used_bytes")})
print("reasons:", format_reasons(stats["reasons"]))
