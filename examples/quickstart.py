"""Exact cross-request prefix reuse on a tiny random-init Qwen3.5-architecture hybrid (runs on CPU in seconds)."""

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from prefixlab import HybridPrefixCache, PrefixStore

config = Qwen3_5TextConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],  # 3:1 GatedDeltaNet : attention
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, pad_token_id=0, eos_token_id=None,
)
torch.manual_seed(0)
model = Qwen3_5ForCausalLM(config).eval()

# the store routes the GatedDeltaNet layers through prefixlab kernels: states are captured inside the one prefill
store = PrefixStore(model, capacity="256MB", policy="dp")
system = torch.randint(1, 1000, (1, 300))
for question in range(3):
    input_ids = torch.cat([system, torch.randint(1, 1000, (1, 20))], dim=1)
    out = model.generate(input_ids, past_key_values=HybridPrefixCache(store), max_new_tokens=16, do_sample=False)
    plain = model.generate(input_ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, plain), "prefix reuse changed the output"
    print(f"request {question}: identical tokens; store: {store.stats()['reused_tokens']} tokens reused so far")
print({k: v for k, v in store.stats().items() if k in ("hit_sequences", "reused_tokens", "used_bytes")})
