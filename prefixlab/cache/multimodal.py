"""Multimodal prompts: placeholder tokens (image, video, audio) whose KV depends on more than their token ids.

Two requests with the same placeholder ids may carry different images. Where a model takes pre-encoded features
(`mm_encoder_outputs`, as generate() passes them) and positions images itself (M-RoPE: Qwen3.5 and its MoE), each
image or video placeholder token is keyed by its content instead: the store sees an id above any vocabulary derived
from a digest of the token's feature row and M-RoPE offset, so the same image again is reused, past it too, and
another image never is; the forward after a reused prefix gets the features of the placeholders it still runs, as
generate's chunked prefill does. Elsewhere (audio, other models) a prefix is reused, and admitted, only up to the
first placeholder of any row: what precedes it is plain text (causal attention), what follows it is not.
"""

from __future__ import annotations

import hashlib
import inspect
import re

import torch

from prefixlab.errors import InvalidInputError

_PLACEHOLDER = re.compile(r"(image|video|audio|vision|boi|eoi|boa|eoa|media).*_token_(id|ids|index)$")
_DELIMITER = re.compile(r"(start|end|boi|eoi|boa|eoa)")  # tokens around media: embedded like text
_INPUT = re.compile(r"pixel|image|video|audio|input_features|encoder_outputs")
KEY_BASE = 1 << 40  # content keys of placeholder tokens lie in [KEY_BASE, KEY_BASE + 2**62): no vocabulary reaches it
TOKEN_KEYS = "prefixlab_token_keys"  # the hooks' own input beside input_ids: the ids the store sees (never the model)


def _named_ids(config, delimiters: bool) -> list[int]:
    found: set[int] = set()
    for part in (config, config.get_text_config()):
        for name, value in vars(part).items():
            if _PLACEHOLDER.search(name) and (delimiters or not _DELIMITER.search(name)):
                values = value if isinstance(value, list | tuple) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    return sorted(found)


def placeholder_token_ids(config) -> list[int]:
    """The token ids a (multimodal) config names as image / video / audio placeholders or their delimiters."""
    return _named_ids(config, delimiters=True)


def has_multimodal_inputs(kwargs: dict) -> bool:
    """Whether a forward carries inputs besides token ids that its tokens' KV depends on (pixel_values, or the
    `mm_encoder_outputs` generate encodes them into: an empty dict for a text-only prompt)."""
    return any(_present(value) and _INPUT.search(name) for name, value in kwargs.items())


def text_only(kwargs: dict, keep_features: bool = False) -> dict:
    """The inputs of a forward segment without its media inputs (before the first placeholder: plain text), or
    with only its (sliced, MediaTokens.sliced) pre-encoded features."""
    return {name: value for name, value in kwargs.items()
            if not _INPUT.search(name) or (keep_features and name == "mm_encoder_outputs")}


def with_model_positions(module: torch.nn.Module, kwargs: dict) -> dict:
    """A first forward's inputs with the positions a vision-language model with M-RoPE (Qwen2/2.5/3-VL, Qwen3.5,
    GLM-4V, ...) gives it when it passes none: [3, batch, length], an image's tokens sharing positions, so its later
    tokens' positions are not their columns. Computing them also sets the rope offset the model keeps for its decode
    steps, as its own forward would. Unchanged where the model counts columns (no M-RoPE, or no image)."""
    owner = next((m for m in (module, getattr(module, "model", None)) if hasattr(m, "compute_3d_position_ids")), None)
    if owner is None:
        return kwargs
    try:
        positions = owner.compute_3d_position_ids(
            input_ids=kwargs["input_ids"], inputs_embeds=None, image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"), attention_mask=kwargs.get("attention_mask"),
            past_key_values=None, mm_token_type_ids=kwargs.get("mm_token_type_ids"))
    except (RuntimeError, ValueError, IndexError) as err:  # (the model's own forward would fail there too)
        raise InvalidInputError(
            f"the image / video inputs do not fit the prompt's placeholder tokens ({err}); pass input_ids, "
            "pixel_values, image_grid_thw and mm_token_type_ids as the model's processor returns them. Nothing was "
            "looked up or admitted"
        ) from err
    return kwargs if positions is None else kwargs | {"position_ids": positions}


def computes_positions(model: torch.nn.Module) -> bool:
    """Whether `model` derives positions from its inputs (M-RoPE): a forward continuing its cache must then not be
    given column positions (after an image they are offset)."""
    return any(hasattr(m, "compute_3d_position_ids") for m in (model, getattr(model, "model", None)))


_RAW = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


class MediaTokens:
    """What the hooks need to know of one model's placeholders (read once from its config; holds no model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.placeholders = placeholder_token_ids(config)
        self.modality_ids = {m: v for m in ("image", "video") if isinstance(v := _config_id(config, m), int)}
        base = getattr(model, "model", model)
        # (not past a QSA indexer, Qwen4-Exp: a resume rebuilds its position history as text positions, rows.py)
        indexed = "indexed_attention" in (getattr(config.get_text_config(), "layer_types", None) or ())
        keyable = ("mm_encoder_outputs" in inspect.signature(model.forward).parameters and computes_positions(model)
                   and hasattr(base, "get_image_features") and hasattr(base, "get_video_features") and not indexed)
        self.keyed_ids = self.modality_ids if keyable else {}  # modality -> placeholder id keyed by content
        # with images and videos keyed, what still stops reuse: other media's placeholders (not their delimiters,
        # embedded as text), and any placeholder in a forward not keyed
        self.unkeyed = [t for t in _named_ids(config, delimiters=False) if t not in self.keyed_ids.values()]
        self.stops = sorted({*self.unkeyed, *self.keyed_ids.values()}) if keyable else self.placeholders

    def keyed(self, module: torch.nn.Module, kwargs: dict, first: bool) -> dict:
        """A forward's inputs (raw pixels encoded as generate() would, so that they can be sliced) with TOKEN_KEYS,
        the ids the store sees for its columns: image and video placeholders keyed by content. Unchanged where
        nothing is keyed (no image or video, or a later forward of a request without the text positions generate
        passes)."""
        for pixels, grid in _RAW.values():  # (else looked up, then the vision tower's AttributeError)
            if self.keyed_ids and kwargs.get(pixels) is not None and kwargs.get(grid) is None:
                raise InvalidInputError(f"{pixels} were given without {grid}: pass both, as the model's processor "
                                        "returns them. Nothing was looked up or admitted")
        present = {m: t for m, t in self.keyed_ids.items() if bool((kwargs["input_ids"] == t).any())}
        if not present:
            return kwargs
        text = _text_positions(kwargs, first)
        if text is None:
            return kwargs
        outputs = dict(kwargs.get("mm_encoder_outputs") or {})
        if any(kwargs.get(pixels) is not None for pixels, _ in _RAW.values()):
            if outputs:
                return kwargs  # pixels and features both given: the model's own error
            base = getattr(module, "model", module)  # the model takes features or pixels: all of them encoded
            for modality, (pixels, grid) in _RAW.items():
                if kwargs.get(pixels) is not None:
                    encode = getattr(base, f"get_{modality}_features")
                    outputs[modality] = encode(kwargs[pixels], kwargs.get(grid), return_dict=True)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("pixel_values", "pixel_values_videos")}
            kwargs |= {"mm_encoder_outputs": outputs}
        keys = kwargs["input_ids"].detach().cpu()
        for modality, token in present.items():
            _check_feature_rows(modality, outputs.get(modality), int((keys == token).sum()))
            keys = content_keys(keys, token, outputs.get(modality), kwargs["position_ids"], text)
            if keys is None:  # (positions of another width: nothing keyed)
                return kwargs
        if first and not _model_positions(module, kwargs):  # (the keys cover an image's own positions only)
            return kwargs
        return kwargs | {TOKEN_KEYS: keys}

    def reusable(self, kwargs: dict) -> int | None:
        """reusable_columns of a forward, its images and videos keyed (TOKEN_KEYS) or not."""
        if (keys := kwargs.get(TOKEN_KEYS)) is None:
            return reusable_columns(self.stops, kwargs)
        others = {m: v for m, v in kwargs["mm_encoder_outputs"].items() if m not in self.keyed_ids}
        rest = {k: v for k, v in kwargs.items() if not _INPUT.search(k) and k != TOKEN_KEYS}
        rest |= {"mm_encoder_outputs": others}
        return reusable_columns(self.unkeyed, rest | {"input_ids": keys})

    def sliced(self, kwargs: dict, start: int, stop: int) -> dict:
        """`kwargs` with its pre-encoded features cut to the placeholders in columns [start, stop) of its input_ids
        (in the (row, column) order the model fills them)."""
        outputs = kwargs.get("mm_encoder_outputs")
        if not outputs or (start == 0 and stop == kwargs["input_ids"].shape[1]):
            return kwargs
        cut = {}
        for modality, output in outputs.items():
            if output is None or modality not in self.modality_ids:
                cut[modality] = output
                continue
            mask = kwargs["input_ids"] == self.modality_ids[modality]
            rows = (mask.flatten().cumsum(0) - 1).view_as(mask)[:, start:stop][mask[:, start:stop]]
            if len(rows):
                cut[modality] = _take_rows(output, rows)
        return kwargs | {"mm_encoder_outputs": cut}


def _check_feature_rows(modality: str, output, placeholders: int) -> None:
    """InvalidInputError if an encoder output's feature rows are not one per placeholder: the model would refuse
    them, but a forward the store shortens carries only the placeholders after the reused columns (and their rows),
    so the mismatch would go unseen."""
    if output is None:
        return  # (placeholder ids without pixels: text, as the model embeds them)
    features = [_flat(output["pooler_output"])]
    if (deepstack := output.get("deepstack_features")) is not None:
        features += [_flat(layer) for layer in deepstack]
    if any(len(f) != placeholders for f in features):
        raise InvalidInputError(
            f"the {modality} inputs give {len(features[0])} feature rows for {placeholders} {modality} placeholder "
            "tokens in input_ids; pass input_ids, pixel values and their grid as the model's processor returns them. "
            "Nothing was looked up or admitted"
        )


def _model_positions(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether a first forward's M-RoPE positions are the ones the model computes for its inputs (generate's, or
    none given): positions a caller set otherwise move the text after an image, which no content key covers."""
    given = kwargs["position_ids"]
    own = with_model_positions(module, {k: v for k, v in kwargs.items() if k != "position_ids"}).get("position_ids")
    if own is None:  # (generate keeps the grids to itself: its 4-row positions are the model's own)
        return len(given) == 4
    return own.shape[-2:] == given.shape[-2:] and torch.equal(own[-3:].to(given.device), given[-3:])


def _config_id(config, modality: str):
    for part in (config, config.get_text_config()):
        for name in (f"{modality}_token_id", f"{modality}_token_index"):
            if isinstance(value := getattr(part, name, None), int):
                return value
    return None


def _flat(features) -> torch.Tensor:
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features]) if isinstance(features, list | tuple) \
        else features.reshape(-1, features.shape[-1])


def _take_rows(output, rows: torch.Tensor):
    """An encoder output holding only the feature `rows` (of its placeholders, flattened) the models read."""
    parts = {"pooler_output": [_flat(output["pooler_output"])[rows]]}
    if (deepstack := output.get("deepstack_features")) is not None:
        parts["deepstack_features"] = [[_flat(layer)[rows]] for layer in deepstack]
    return type(output)(**parts)


def _text_positions(kwargs: dict, first: bool) -> torch.Tensor | None:
    """[batch, t] each column's position as text (its index among the row's real tokens): generate's first row of
    four, or, in a request's first forward, counted from the left-padding mask."""
    positions = kwargs.get("position_ids")
    if positions is None or positions.dim() != 3:
        return None
    if len(positions) == 4:
        return positions[0]
    if not first:
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == kwargs["input_ids"].shape:
        return mask.long().cumsum(-1) - 1
    return torch.arange(kwargs["input_ids"].shape[1]).expand_as(kwargs["input_ids"])


def content_keys(input_ids: torch.Tensor, token_id: int, output, position_ids: torch.Tensor,
                 text_positions: torch.Tensor) -> torch.Tensor | None:
    """`input_ids` with each `token_id` placeholder (an image's or a video's) replaced by an id drawn from a digest of
    its feature row (and deepstack rows) and of its M-RoPE position less its position as text. What precedes a token
    is keyed by the ids before it, so equal keys mean equal KV, at any depth of an image and whatever the forward's
    chunking. None if the features do not match the placeholders (the model raises its own error)."""
    ids = input_ids.detach().cpu()
    mask = ids == token_id
    features = [] if output is None else [_flat(output["pooler_output"])]
    if output is not None and (deepstack := output.get("deepstack_features")) is not None:
        features += [_flat(layer) for layer in deepstack]
    if not features or any(len(f) != int(mask.sum()) for f in features) or position_ids.shape[-1] != ids.shape[1]:
        return None
    tag = str([token_id, *((f.dtype, f.shape[-1]) for f in features)]).encode()
    rows = [f.detach().cpu().contiguous().view(torch.uint8).numpy() for f in features]
    offsets = (position_ids[-3:].detach().cpu().long() - text_positions.detach().cpu().long()).numpy()
    keys = ids.clone()
    for k, (row, column) in enumerate(mask.nonzero().tolist()):  # (row, column) order: the model's fill order
        digest = hashlib.blake2b(tag + offsets[:, row, column].tobytes(), digest_size=8)
        for f in rows:
            digest.update(f[k].tobytes())
        keys[row, column] = KEY_BASE + (int.from_bytes(digest.digest(), "little") >> 2)
    return keys


def first_key(ids: torch.Tensor) -> int:
    """The first column of [batch, length] ids (CPU) holding a content key in any row (length if none): positions
    past it follow the image (M-RoPE), which the key covers."""
    keyed = ids >= KEY_BASE
    rows = keyed.any(dim=1)
    return int(keyed[rows].int().argmax(dim=1).min()) if bool(rows.any()) else ids.shape[1]


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
