"""Questions about images on a tiny random-init Qwen3.5 with its vision tower (CPU, seconds): each image's tokens are
keyed by its content, so a question about an image seen before reuses the image (and the text around it) and skips
the vision tower, and a question about another image never reuses the first one's KV."""

import copy

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from prefixlab import HybridPrefixCache, PrefixStore

IMAGE, VIDEO, START, END = 996, 997, 998, 999  # placeholder ids (a processor's; here the last of a 1000-token vocab)
text = Qwen3_5TextConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    pad_token_id=0, eos_token_id=None,
)
vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, image_token_id=IMAGE,
                       video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
torch.manual_seed(0)
model = Qwen3_5ForConditionalGeneration(config).eval()
plain = copy.deepcopy(model)  # the same weights, never served by prefixlab: what outputs must equal

system = torch.randint(1, 990, (200,)).tolist()
images = [torch.randn(64, 3 * 2 * 14 * 14) for _ in range(2)]  # 8 x 8 patches each: 16 placeholder tokens
grid = torch.tensor([[1, 8, 8]])


def inputs(image: int, question: list[int]) -> dict:
    """What a processor returns for system prompt + image + question."""
    ids = torch.tensor([system + [START] + [IMAGE] * 16 + [END] + question])
    return dict(input_ids=ids, pixel_values=images[image], image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())


store = PrefixStore(model, capacity="256MB")  # media_cache="256MiB" (the default) keeps encoded images too
encoded = []
model.model.visual.register_forward_hook(lambda *_: encoded.append(1))
for image in (0, 0, 1, 0, 1):
    question = torch.randint(1, 990, (12,)).tolist()
    cache, encoded[:] = HybridPrefixCache(store), []
    out = model.generate(**inputs(image, question), past_key_values=cache, max_new_tokens=8, do_sample=False)
    reference = plain.generate(**inputs(image, question), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, reference), "prefix reuse changed the output"
    print(f"image {image}: identical tokens; reused {cache.reused_tokens} of {out.shape[1] - 8} prompt tokens, "
          f"vision tower runs: {len(encoded)}")
store.close()
