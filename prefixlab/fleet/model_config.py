"""`--model`'s config.json: read it, and say what is wrong with it when a value in it is malformed (a string for a
size, a number for a sub-config, a division by zero it leads to), as one InvalidInputError naming config.json,
never transformers' traceback. Only transformers' config and model-building code runs inside the catches here."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from prefixlab.errors import InvalidInputError

# the keys transformers' get_text_config reads as the text model's own config (a PreTrainedConfig, or absent)
TEXT_CONFIG_KEYS = ("text_config", "decoder", "generator", "text_encoder")

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def config_value_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises building a config, or a model from it, out of a malformed value: its strict
    dataclass checks (StrictDataclassError, TypeError, ValueError), or plain Python errors where a value is used
    unchecked (a number read as a sub-config: AttributeError; a zero head count: ZeroDivisionError)."""
    from huggingface_hub.errors import StrictDataclassError

    return ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, StrictDataclassError


def reason(err: BaseException) -> str:
    """`err` on one line; any other than transformers' own checks (a plain Python error, whose message names no
    setting) with its type and the line of transformers that raised it, e.g. `hidden_size // num_attention_heads`."""
    from huggingface_hub.errors import StrictDataclassError

    text = " ".join(str(err).split())
    if isinstance(err, (ValueError, StrictDataclassError)) and text:  # (transformers' own messages)
        return text
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    lines = [frame.line for frame in traceback.extract_tb(err.__traceback__)
             if "transformers" in Path(frame.filename).parts and frame.line]
    return f"{text}, at `{lines[-1]}`" if lines else text


def _malformed(model: str, path: Path, problem: str, name: str = "config.json") -> InvalidInputError:
    which = f"its {name}" if path.is_dir() else f"the {name}"
    return InvalidInputError(f"--model {model!r}: {which} {problem}; fix it, or copy the model's original {name}")


def _json_object(model: str, path: Path, file: Path, name: str = "config.json") -> dict:
    """The settings `file` holds, or an InvalidInputError naming it: transformers' own messages say neither where
    the JSON breaks nor that it is no object."""
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _malformed(model, path, "is not UTF-8 text", name) from None
    except OSError as err:
        raise InvalidInputError(f"--model {model!r}: cannot read {file} ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise _malformed(model, path, f"is not valid JSON ({err.msg}: line {err.lineno} column {err.colno})",
                         name) from None
    if not isinstance(settings, dict):
        raise _malformed(model, path, f"holds {_JSON_KINDS.get(type(settings), 'a value')}, not an object of "
                         "settings", name)
    return settings


def load_config(model: str, path: Path, generation: bool = False):
    """The transformers config of `path` (a config.json, or a folder holding one), or an InvalidInputError naming
    config.json and what is wrong with it. `generation`: a folder's generation_config.json too (generating from it:
    from_pretrained would replace it without a word by one made from config.json where it does not read, with other
    EOS ids)."""
    from transformers import AutoConfig, GenerationConfig, PreTrainedConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():  # (transformers: "Unrecognized model ... Should have a `model_type` key")
        raise InvalidInputError(f"--model {model!r} is a folder without a config.json file; copy the model's "
                                "config.json into it" if path.is_dir() else f"--model {model!r} is not a regular "
                                "file; pass a config.json or a model folder")
    _json_object(model, path, file)
    if generation and path.is_dir() and (path / "generation_config.json").exists():
        _json_object(model, path, path / "generation_config.json", "generation_config.json")
        try:
            GenerationConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, *config_value_errors()) as err:
            raise _malformed(model, path, f"has a malformed value ({reason(err)})", "generation_config.json") \
                from None
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except OSError as err:  # (read above: not expected)
        raise InvalidInputError(f"--model {model!r}: cannot read its config.json ({reason(err)})") from None
    except config_value_errors() as err:
        raise _malformed(model, path, f"has a malformed value ({reason(err)})") from None
    for key in TEXT_CONFIG_KEYS:  # a flat config keeps an unknown key as it is: transformers reads a number here
        value = getattr(config, key, None)
        if value is not None and not isinstance(value, PreTrainedConfig):
            raise _malformed(model, path, f"sets {key!r} to {json.dumps(value, default=repr)}, where transformers "
                             "reads the text model's config: an object of settings, or no such key")
    return config


def causal_lm_class(config):
    """The auto class that builds `config`'s generating model: AutoModelForCausalLM, or for a model whose only
    generating class is its vision-language one (GLM-5-Next), AutoModelForImageTextToText (prompts are text)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) not in AutoModelForCausalLM._model_mapping and \
            type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def check_builds(model: str, path: Path, auto, config) -> None:
    """After building the model failed: an InvalidInputError naming config.json if `config` alone does not build
    `auto`'s model either (on the meta device: no memory taken, no file read), so that its values are to blame."""
    import torch

    try:
        with torch.device("meta"):
            auto.from_config(config)
    except (*config_value_errors(), RuntimeError, AssertionError) as err:  # (RuntimeError: a negative size)
        raise _malformed(model, path, f"does not build a causal LM ({reason(err)})") from None


def check_complete(model: str, path: Path, loaded, info: dict) -> None:
    """An InvalidInputError where the weights files lack parameters of the model built from them (a folder saved by
    AutoModel, without the LM head, or by another class): from_pretrained fills those with random values, so every
    run, and every process, would serve other outputs."""
    parameters = {name for name, _ in loaded.named_parameters()}
    if missing := sorted(set(info.get("missing_keys", ())) & parameters):
        raise InvalidInputError(
            f"--model {model!r}: its weights lack {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}), which would be random: the folder holds an incomplete checkpoint "
            f"or another class's (config.json says architectures {getattr(loaded.config, 'architectures', None)}); "
            "pass a causal LM's folder (saved by AutoModelForCausalLM)")


def check_runs(model: str, path: Path, loaded, info: dict | None = None):
    """`loaded` (the model built), once its first forward (two tokens into the model's own cache, as generate's
    first step, before prefixlab touches the model) and a one-token generate as `prefixlab run` decodes ran; if one
    fails, an InvalidInputError naming the file to blame: values that build but do not fit together (key/value heads
    that do not divide the heads, Mamba2 groups that do not divide its heads, a zero conv window, a hybrid without
    attention layers: config.json), a malformed generation setting (an EOS id that is a string:
    generation_config.json), not met as the model's traceback in the first generate. `info`: from_pretrained's
    loading info (check_complete)."""
    import torch

    from prefixlab.fleet.generation_options import GREEDY
    from prefixlab.fleet.stops import check_model_stop_strings

    check_complete(model, path, loaded, info or {})
    tokens = torch.zeros(1, 2, dtype=torch.long, device=loaded.device)
    _runs(model, path, "config.json", "builds a model whose forward fails",
          lambda: loaded(input_ids=tokens, use_cache=True))
    check_model_stop_strings(loaded, model)  # (generate would fail for want of a tokenizer; its message says more)
    pad = getattr(loaded.config, "pad_token_id", None)
    _runs(model, path, "generation_config.json" if (path / "generation_config.json").exists() else "config.json",
          "makes generate fail", lambda: loaded.generate(tokens, attention_mask=torch.ones_like(tokens),
                                                         max_new_tokens=1, pad_token_id=pad if isinstance(pad, int)
                                                         else 0, **GREEDY))
    return loaded


def _runs(model: str, path: Path, name: str, what: str, call) -> None:
    """`call()`, or an InvalidInputError blaming `name` for what it raised."""
    import torch

    try:
        with torch.no_grad():  # (not inference_mode: a buffer a forward assigns must stay a normal tensor)
            call()
    except torch.OutOfMemoryError:  # (a RuntimeError, but the machine's, not the config's)
        raise
    except (*config_value_errors(), RuntimeError, AssertionError) as err:
        raise _malformed(model, path, f"{what} ({reason(err)})", name) from None
