"""The tiny multimodal Qwen3.5 of the multimodal tests and the inputs they feed it."""

import torch
import transformers as tf
from hf_models import config as text_config

IMAGE, VIDEO, START, END = 120, 121, 122, 123
GRID = torch.tensor([[1, 2, 2]])  # one 28 x 28 image: 4 patches of 14, merged 2 x 2 into one placeholder token
GRID_4 = torch.tensor([[1, 4, 4]])  # 16 patches merged 2 x 2: four placeholder tokens, whose M-RoPE positions are 2D
TEXT = list(range(5, 13))  # the text before the image: what may be reused


# family -> (composite config class, model class) of the vision-language models the tests build
_COMPOSITES = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
               "qwen4_exp": ("Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration")}


def build_model(family: str = "qwen3_5"):
    """A tiny Qwen3.5 (or `family`) with its vision tower (Gated DeltaNet + attention layers, as the real one)."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config_class, model_class = (getattr(tf, name) for name in _COMPOSITES[family])
    config = config_class(text_config=text_config(family).to_dict(), vision_config=vision, image_token_id=IMAGE,
                          video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return model_class(config).eval()


def pixels(seed):
    return torch.randn(4, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))


def assert_same(reference, served):
    assert torch.equal(reference[0], served[0])
    torch.testing.assert_close(reference[1], served[1], atol=1e-5, rtol=0)


def image_inputs(ids: list[int], seed: int) -> dict:
    """A direct forward's inputs for one prompt with one 4-token image (as the processor returns them)."""
    return {"input_ids": torch.tensor([ids]), "image_grid_thw": GRID_4,
            "pixel_values": torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed)),
            "mm_token_type_ids": torch.tensor([[int(t == IMAGE) for t in ids]])}
