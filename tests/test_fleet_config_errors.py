"""`prefixlab run` (and `run --plan`) on a model whose config.json has a malformed value: one error line naming
config.json and what is wrong, exit code 2, no traceback (old code: `"text_config": 3` gave an AttributeError
traceback); a folder of weights or its config.json alone, the same. No model runs here."""

import json

import pytest
import torch
from hf_models import config as tiny_config

from prefixlab.cli import main
from prefixlab.fleet import loading


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny hybrid's folder (config.json, weights) and a one-prompt file."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("config_errors")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).save_pretrained(str(folder / "model"))
    (folder / "prompts.jsonl").write_text('{"id": 1, "input_ids": [5, 6, 7], "max_new_tokens": 2}\n')
    return folder


def edited(**values):
    return lambda config: json.dumps(config | values)


MALFORMED = {  # config.json (from the folder's own settings) -> what the error says besides "config.json"
    "text_config is a number": (edited(text_config=3), "sets 'text_config' to 3"),
    "text_config is a string": (edited(text_config="abc"), "sets 'text_config' to \"abc\""),
    "a string for a size": (edited(hidden_size="abc"), "'hidden_size' expected int"),
    "a negative layer count": (edited(num_hidden_layers=-1), "`num_hidden_layers` (-1)"),
    "a number for a list": (edited(layer_types=5), "Field 'layer_types'"),
    "a number for model_type": (edited(model_type=7), "model type `7`"),
    "a list": (lambda config: json.dumps([config]), "holds an array, not an object"),
    "null": (lambda config: "null", "holds null"),
    "not JSON": (lambda config: json.dumps(config)[:-9], "is not valid JSON ("),
    "no head": (edited(num_attention_heads=0), "ZeroDivisionError"),
    "a negative size": (edited(hidden_size=-1), "negative dimension -1"),
    "a number for dtype": (edited(dtype=5), "dtype"),
    "a pad id beyond the vocabulary": (edited(pad_token_id=999), "Padding_idx must be within num_embeddings"),
    "an unknown rope type": (edited(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}), "'bogus'"),
}


@pytest.mark.parametrize("plan", [False, True], ids=["run", "plan"])
@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_config_json_is_one_clear_error(capsys, folder, tmp_path, case, plan):
    write, message = MALFORMED[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(folder / "model" / "model.safetensors")
    (model / "config.json").write_text(write(json.loads((folder / "model" / "config.json").read_text())))
    for given in (model, model / "config.json"):  # a folder of weights, or its config.json alone (random init)
        out = tmp_path / "out.jsonl"
        code = main(["run", folder / "prompts.jsonl", "--model", given, "--out", out, "--cpu",
                     *(["--plan"] if plan else [])])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (transformers may warn about the config first)
        assert code == 2 and "Traceback" not in err and not out.exists(), err
        assert last.startswith(f"prefixlab: error: --model '{given}': ") and "config.json" in last, last
        assert message in last and last.endswith("; fix it, or copy the model's original config.json"), last


def test_a_folder_without_a_config_json(capsys, folder, tmp_path):
    (tmp_path / "model.safetensors").symlink_to(folder / "model" / "model.safetensors")
    assert main(["run", folder / "prompts.jsonl", "--model", tmp_path, "--out", tmp_path / "o.jsonl"]) == 2
    assert "is a folder without a config.json file" in capsys.readouterr().err


def test_an_error_of_its_own_building_a_model_from_a_good_config_is_not_blamed_on_it(monkeypatch, folder):
    # only a config that does not build a model alone is blamed: a bug elsewhere keeps its traceback
    def fails(*args, **kwargs):
        raise AttributeError("a bug while building the model")

    monkeypatch.setattr(loading, "_meta_model", fails)
    with pytest.raises(AttributeError, match="a bug while building the model"):
        loading.load_model(str(folder / "model"), meta=True)


BUILDS_BUT_FAILS = {  # family, config.json values a model builds from whose first forward fails (shapes that differ)
    "key/value heads not dividing the heads": ("qwen3_5", dict(num_key_value_heads=3)),
    "linear-attention value heads not a multiple of its key heads": ("qwen3_5", dict(linear_num_value_heads=3)),
    "Mamba2 groups not dividing its heads": ("bamba", dict(mamba_n_groups=3)),
    "a zero conv window": ("lfm2", dict(conv_L_cache=0)),
    "a hybrid without attention layers (transformers' cache cannot tell a length)": (
        "qwen3_5", dict(layer_types=["linear_attention"] * 4)),
}


@pytest.mark.parametrize("case", BUILDS_BUT_FAILS)
def test_a_config_json_whose_model_builds_but_cannot_run_is_one_clear_error(capsys, tmp_path, case):
    # old code: built, then the first generate raised the model's RuntimeError traceback (config alone, or a folder
    # whose weights were saved with that config, so its shapes fit); the plan runs no forward: not checked there
    from transformers import AutoModelForCausalLM

    family, values = BUILDS_BUT_FAILS[case]
    (tmp_path / "prompts.jsonl").write_text('{"id": 1, "input_ids": [5, 6, 7], "max_new_tokens": 2}\n')
    config = type(tiny_config(family)).from_dict(tiny_config(family).to_dict() | values)
    model = tmp_path / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(model))
    for given in (model, model / "config.json"):  # a folder of weights, or its config.json alone (random init)
        out = tmp_path / "out.jsonl"
        code = main(["run", tmp_path / "prompts.jsonl", "--model", given, "--out", out, "--cpu"])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in err and not out.exists(), err
        assert last.startswith(f"prefixlab: error: --model '{given}': ") and "config.json" in last, last
        assert "builds a model whose forward fails (" in last, last
        assert last.endswith("; fix it, or copy the model's original config.json"), last


@pytest.mark.parametrize("plan", [False, True], ids=["run", "plan"])
@pytest.mark.parametrize("content, message", [
    ('{"eos_token_id": [2, 7]', "is not valid JSON (Expecting ',' delimiter: line 1 column 24)"),
    ("[2, 7]", "holds an array, not an object of settings"),
    ('{"max_new_tokens": -5}', "has a malformed value (`max_new_tokens` must be greater than 0, but is -5.)"),
])
def test_a_generation_config_json_that_cannot_be_read_is_one_clear_error(capsys, folder, tmp_path, plan, content,
                                                                         message):
    """A damaged generation_config.json (a download cut short) was replaced without a word by one made from
    config.json (from_pretrained's fallback): other EOS ids, so other outputs; `--plan` failed with "cannot build a
    causal LM" (or the reverse)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(folder / "model" / "model.safetensors")
    (model / "config.json").write_text((folder / "model" / "config.json").read_text())
    (model / "generation_config.json").write_text(content)
    out = tmp_path / "out.jsonl"
    code = main(["run", folder / "prompts.jsonl", "--model", model, "--out", out, "--cpu",
                 *(["--plan"] if plan else [])])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and not out.exists(), err
    assert last.startswith(f"prefixlab: error: --model '{model}': its generation_config.json {message}"), last


def test_a_generation_config_json_that_makes_generate_fail_is_one_clear_error(capsys, folder, tmp_path):
    """An EOS id that is a string read as a generation config, then failed every prompt's generate with a raw
    TypeError (the plan runs nothing: not checked there)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(folder / "model" / "model.safetensors")
    (model / "config.json").write_text((folder / "model" / "config.json").read_text())
    (model / "generation_config.json").write_text('{"eos_token_id": "2"}')
    out = tmp_path / "out.jsonl"
    code = main(["run", folder / "prompts.jsonl", "--model", model, "--out", out, "--cpu"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and not out.exists(), err
    assert last.startswith(f"prefixlab: error: --model '{model}': its generation_config.json makes generate fail ("
                           "TypeError: "), last
