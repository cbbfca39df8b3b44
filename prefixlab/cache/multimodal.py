"""Multimodal prompts: placeholder tokens (image, video, audio) whose KV depends on more than their token ids.

Two requests with the same placeholder ids may carry different images, so a prefix is reused, and admitted, only up
to the first placeholder of any row: what precedes it is plain text (causal attention), what follows it is not.
"""

from __future__ import annotations

import re

import torch

_PLACEHOLDER = re.compile(r"(image|video|audio|vision|boi|eoi|boa|eoa|media).*_token_(id|ids|index)$")
_INPUT = re.compile(r"pixel|image|video|audio|input_features|encoder_outputs")


def placeholder_token_ids(config) -> list[int]:
    """The token ids a (multimodal) config names as image / video / audio placeholders or their delimiters."""
    found: set[int] = set()
    for part in (config, config.get_text_config()):
        for name, value in vars(part).items():
            if _PLACEHOLDER.search(name):
                values = value if isinstance(value, list | tuple) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    return sorted(found)


def has_multimodal_inputs(kwargs: dict) -> bool:
    """Whether a forward carries inputs besides token ids that its tokens' KV depends on (pixel_values, or the
    `mm_encoder_outputs` generate encodes them into: an empty dict for a text-only prompt)."""
    return any(_present(value) and _INPUT.search(name) for name, value in kwargs.items())


def text_only(kwargs: dict) -> dict:
    """The inputs of a forward segment that holds no placeholder (before the first: plain text), without the images."""
    return {name: value for name, value in kwargs.items() if not _INPUT.search(name)}


def model_positions(module: torch.nn.Module, kwargs: dict) -> torch.Tensor | None:
    """The positions a vision-language model with M-RoPE (Qwen2/2.5/3-VL, Qwen3.5, GLM-4V, ...) gives a first forward
    that passes none: [3, batch, length], an image's tokens sharing positions, so its later tokens' positions are
    not their columns. Computing them also sets the rope offset the model keeps for its decode steps, as its own
    forward would. None where the model counts columns (no M-RoPE, or no image in the forward)."""
    owner = next((m for m in (module, getattr(module, "model", None)) if hasattr(m, "compute_3d_position_ids")), None)
    if owner is None:
        return None
    return owner.compute_3d_position_ids(
        input_ids=kwargs["input_ids"], inputs_embeds=None, image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=kwargs.get("video_grid_thw"), attention_mask=kwargs.get("attention_mask"),
        past_key_values=None, mm_token_type_ids=kwargs.get("mm_token_type_ids"))


def computes_positions(model: torch.nn.Module) -> bool:
    """Whether `model` derives positions from its inputs (M-RoPE): a forward continuing its cache must then not be
    given column positions (after an image they are offset)."""
    return any(hasattr(m, "compute_3d_position_ids") for m in (model, getattr(model, "model", None)))


def _present(value) -> bool:
    if isinstance(value, dict):
        return any(_present(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_present(v) for v in value)
    return value is not None


def reusable_columns(placeholders: list[int], kwargs: dict) -> int | None:
    """Leading columns of this forward's input_ids that may come from (and go to) the store: up to the first
    `placeholders` token (placeholder_token_ids) of any row; 0 for multimodal inputs on a model whose placeholders
    are unknown; None: all."""
    ids = kwargs["input_ids"]
    if placeholders:
        hits = torch.isin(ids, torch.tensor(placeholders, device=ids.device))
        rows = hits.any(dim=1)
        if bool(rows.any()):
            return int(hits[rows].int().argmax(dim=1).min())
    return 0 if has_multimodal_inputs(kwargs) else None
