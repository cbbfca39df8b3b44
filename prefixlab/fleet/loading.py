"""Loading `run`'s model: a config.json (random init, the same weights in every process) or a local model folder
(its weights checked before they serve: a missing or damaged file is named), and the digest processes compare."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefixlab.errors import InvalidInputError
from prefixlab.fleet import model_config
from prefixlab.fleet.model_config import causal_lm_class, check_builds, config_value_errors, load_config, reason


def load_model(model: str, seed: int = 0, device: str = "cpu", meta: bool = False):
    """A transformers causal LM from a config.json (random init after torch.manual_seed(seed), so every process
    builds the same weights) or a local model folder with weights (from_pretrained, local files only), in eval
    mode on `device`. `meta`: the same model on the meta device, no weights read or made (`run --plan`): its
    config, generation config, dtype (as from_pretrained picks it: the config's, else the first checkpoint file's)
    and module structure only."""
    import torch

    path = Path(model)
    if not path.exists():
        raise InvalidInputError(f"--model {model!r}: no such file or folder; pass a config.json or a local model "
                                "folder (nothing is downloaded)")
    has_weights = path.is_dir() and bool(_weights_files(path))
    if path.is_dir() and not has_weights:  # a folder whose weights never arrived must not serve random ones
        raise InvalidInputError(f"--model {model!r} is a folder without weights (*.safetensors or *.bin); pass a "
                                "folder with them, or its config.json to run random-init weights on purpose")
    config = load_config(model, path, generation=True)
    auto = causal_lm_class(config)
    try:
        if meta:
            return _meta_model(auto, config, path if has_weights else None)
        if has_weights:
            loaded, info = auto.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
        else:
            torch.manual_seed(seed)
            loaded, info = auto.from_config(config), {}
    except (*config_value_errors(), AssertionError, OSError) as err:
        check_builds(model, path, auto, config)  # else not a value of config.json: an error of its own
        if isinstance(err, (AttributeError, IndexError, ZeroDivisionError, AssertionError)):  # not the input's
            raise
        raise InvalidInputError(f"--model {model!r}: cannot build a causal LM ({reason(err)})") from None
    except _weights_read_errors() as err:
        damaged = _unreadable_weights(path) if has_weights else None
        if damaged is None and has_weights and "ignore_mismatched_sizes" in str(err):  # (transformers' wording)
            raise InvalidInputError(f"--model {model!r}: its weights do not fit its config.json (tensor shapes differ; "
                                    "transformers printed which above): pass the folder's own config, the one the "
                                    "weights were saved with") from None
        if damaged is None:  # every file reads: a value of config.json (a negative size), else not the input's error
            check_builds(model, path, auto, config)
            raise
        raise InvalidInputError(f"--model {model!r}: the weights file {damaged}; it is damaged or incomplete, or not "
                                "a checkpoint: copy or save it again") from None
    return model_config.check_runs(model, path, loaded.to(device).eval(), info)


def _weights_files(folder: Path) -> list[Path]:
    """`folder`'s weights files, safetensors first (from_pretrained's preference)."""
    return [*sorted(folder.glob("*.safetensors")), *sorted(folder.glob("*.bin"))]


def _weights_read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged weights file raises: safetensors' header error; torch's zip reader (RuntimeError),
    weights-only unpickler, or a file cut short (EOFError)."""
    import pickle

    from safetensors import SafetensorError

    return SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError


def _checkpoint_files(folder: Path) -> list[Path]:
    """The weights files from_pretrained reads from `folder`, in its order: model.safetensors, else the shards its
    index names, else pytorch_model.bin, else its index's shards (other files, such as a Trainer's
    training_args.bin or an adapter's safetensors, are never read); `_weights_files` where none of these is there."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError, OSError):
                break  # (from_pretrained refuses the index itself)
            return [folder / name for name in shards if (folder / name).is_file()] or _weights_files(folder)
    return _weights_files(folder)


def _unreadable_weights(folder: Path) -> str | None:
    """The first weights file of `folder` that from_pretrained reads and that does not read as a checkpoint (its
    header and tensor list only, on the meta device), and why; None if every one reads (what failed was not a
    file)."""
    from transformers.modeling_utils import load_state_dict

    for file in _checkpoint_files(folder):
        try:
            load_state_dict(str(file), map_location="meta")
        except _weights_read_errors() as err:
            why = " ".join(str(err).split(". ")[0].split()) or type(err).__name__  # (torch's advice left out)
            return f"{file.name} cannot be read ({why})"
    return None


def _meta_model(auto, config, folder: Path | None):
    """`auto`'s model of `config` on the meta device, with the dtype and generation config from_pretrained would
    give it from `folder` (None: from_config's)."""
    import torch
    from transformers import GenerationConfig

    options = {}
    if folder is not None:
        dtype = getattr(config, "dtype", None)
        if dtype is None:  # from_pretrained's "auto": the first floating tensor of the first checkpoint file
            from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

            first = _checkpoint_files(folder)[0]
            dtype = get_state_dict_dtype(load_state_dict(str(first), map_location="meta"))
        options["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        loaded = auto.from_config(config, **options)
    if folder is not None and (folder / "generation_config.json").is_file():
        loaded.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return loaded.eval()


def model_digest(model) -> str:
    """A short hash of what outputs depend on besides the prompt: (a sample of) the weights' bits, the config and
    the generation config (a rope_theta or eos_token_id of their own changes outputs, not weights). Processes
    compare it to catch differently seeded models; a resumed run, to catch another model."""
    digest = hashlib.sha256()
    for config in (model.config, model.generation_config):
        settings = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        sample = tensor.detach().reshape(-1)[:4096].cpu().contiguous()
        digest.update(name.encode())
        # float() is exact for fp16/bf16 (numpy has no bf16), so equal bits give equal bytes
        digest.update((sample.float() if sample.dtype.is_floating_point else sample).numpy().tobytes())
    return digest.hexdigest()[:16]
