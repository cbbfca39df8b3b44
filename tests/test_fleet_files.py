"""`prefixlab run`'s files read before a model runs: a prompt file's bad lines, an OUT file that is not one of its
outputs, a model folder without readable weights (no model runs here; tests/test_fleet_run.py runs it)."""

import argparse
import io
import json

import pytest
import torch
from hf_models import config as tiny_config

from prefixlab.cli import main
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import loading, outputs
from prefixlab.fleet.prompts import read_prompts


def test_a_token_id_beyond_64_bits_is_a_bad_line(tmp_path):
    bad = tmp_path / "huge.jsonl"
    bad.write_text('{"id": 1, "input_ids": [5, 99999999999999999999999]}\n{"id": 2, "input_ids": [5, 6]}\n')
    with pytest.raises(InvalidInputError, match=rf"{bad}:1: 'input_ids' must be a list of token ids"):
        read_prompts(bad, vocab_size=128)
    assert [p.id for p in read_prompts(bad, on_error="skip")] == [2]


def test_an_output_record_whose_id_is_not_a_prompt_id_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    for record in ('{"id": [1]}', '{"id": {"a": 1}}', '{"id": null}', '{"id": true}'):
        out.write_text(record + "\n")
        with pytest.raises(InvalidInputError, match="not a prefixlab run output"):
            outputs.finished(out)


def test_an_output_file_that_is_not_utf8_is_refused_and_a_bom_is_read(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'\xff\xfe{"id": 1}\n')
    with pytest.raises(InvalidInputError, match="not a prefixlab run output"):
        outputs.finished(out)
    out.write_bytes(b'\xef\xbb\xbf{"id": 1, "output_ids": [8]}\n{"id": 2, "output_ids": [9]}\n')  # saved by an editor
    assert list(outputs.finished(out)) == [1, 2]


def test_a_prompt_file_is_not_an_output(tmp_path):
    """A line with an id but no output_ids (a prompt file passed as --out) was taken as a finished record."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "input_ids": [5, 6]}\n')
    with pytest.raises(InvalidInputError, match="not a prefixlab run output.*output_ids"):
        outputs.finished(out)


@pytest.mark.parametrize("name", ["out[1].jsonl", "o?.jsonl", "o*.jsonl", "shard"])
def test_only_this_runs_own_part_files_are_read(tmp_path, name):
    """OUT's part files were found by the glob OUT.part*: a name with [ ] never found its own, `?` and `*` took
    another run's (and the merge deleted them), and `shard` took shard.part1.jsonl, a prompt file."""
    out = tmp_path / name
    own = [outputs.part_path(out, rank) for rank in (0, 1, 12)]
    others = [tmp_path / "oa.jsonl.part0", tmp_path / "shard.part1.jsonl", tmp_path / f"{name}.part1x",
              tmp_path / f"{name}.partial"]
    for path in own + others:
        path.write_text('{"id": 1, "output_ids": [8]}\n')
    assert outputs.part_files(out) == sorted(own)
    outputs.merge(out, [1])
    assert not any(path.exists() for path in own) and all(path.exists() for path in others)


def test_a_line_nested_too_deep_is_a_bad_line(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6]}\n' + "[" * 100_000 + "\n")
    with pytest.raises(InvalidInputError, match=rf"{prompts}:2: .*recursion"):
        read_prompts(prompts)
    assert [p.id for p in read_prompts(prompts, on_error="skip")] == [1]
    out.write_text("[" * 100_000 + "\n")
    with pytest.raises(InvalidInputError, match="not a prefixlab run output"):
        outputs.finished(out)


def test_records_of_another_prompt_files_ids_are_kept_with_a_note(tmp_path, capsys):
    """An OUT written from another prompt file was merged without a word, its records counted as written."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "output_ids": [8]}\n{"id": 7, "output_ids": [9]}\n')
    outputs.part_path(out, 0).write_text('{"id": 1, "output_ids": [3]}\n')
    assert outputs.merge(out, [1, 2]) == (1, [2])
    assert "holds 2 records of ids not in this prompt file" in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, "a", 7]


def test_a_model_folder_without_readable_weights_is_refused(capsys, tmp_path):
    prompts, model, whole = tmp_path / "prompts.jsonl", tmp_path / "model", io.BytesIO()
    prompts.write_text('{"id": 1, "input_ids": [5, 6]}\n')
    model.mkdir()
    tiny_config("qwen3_5").to_json_file(model / "config.json")
    assert main(["run", prompts, "--model", model, "--out", tmp_path / "o.jsonl"]) == 2
    assert "is a folder without weights" in capsys.readouterr().err  # config.json only: no silent random weights
    config = json.loads((model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": "many"}))  # (was a StrictDataclassError)
    assert main(["run", prompts, "--model", tmp_path / "config.json", "--out", tmp_path / "o.jsonl"]) == 2
    assert "the config.json has a malformed value (Validation error for field 'vocab_size'" in capsys.readouterr().err
    torch.save({"w": torch.zeros(8)}, whole)
    # a damaged file is named (was a SafetensorError, UnpicklingError, RuntimeError or EOFError traceback)
    for name, content in (("pytorch_model.bin", whole.getvalue()[:-40]), ("pytorch_model.bin", b"not weights"),
                          ("pytorch_model.bin", b""), ("model.safetensors", b"not weights")):  # (cut short, garbage)
        (model / name).write_bytes(content)
        assert main(["run", prompts, "--model", model, "--out", tmp_path / "o.jsonl"]) == 2
        assert f"the weights file {name} cannot be read" in capsys.readouterr().err


def test_an_error_building_a_model_from_readable_weights_is_not_taken_for_damage(monkeypatch, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tiny_config("qwen3_5").to_json_file(tmp_path / "config.json")
    save_file({"w": torch.zeros(8)}, tmp_path / "model.safetensors")

    def fails(*args, **kwargs):
        raise RuntimeError("a bug while building the model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fails)
    with pytest.raises(RuntimeError, match="a bug while building the model"):
        loading.load_model(str(tmp_path))


def test_only_the_files_from_pretrained_reads_are_blamed_or_read_for_the_dtype(tmp_path):
    """A fine-tuned folder holds files from_pretrained never reads (the Trainer's training_args.bin, a pickle that is
    no checkpoint; an adapter's safetensors): an error building the model is not blamed on them as damage (old code:
    'the weights file training_args.bin cannot be read ... copy or save it again'), and --plan's meta model takes
    its dtype from the checkpoint from_pretrained loads, not the first file by name (adapter_model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).to(torch.bfloat16).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))  # (from_pretrained's dtype: the checkpoint's)
    save_file({"lora.weight": torch.zeros(4, dtype=torch.float32)}, folder / "adapter_model.safetensors")
    torch.save({"learning_rate": 1e-4, "args": argparse.Namespace(seed=1)}, folder / "training_args.bin")
    assert loading.load_model(str(folder)).dtype == loading.load_model(str(folder), meta=True).dtype == torch.bfloat16
    assert loading._unreadable_weights(folder) is None  # the checkpoint reads: not a damaged file's error
    (folder / "model.safetensors").write_bytes(b"not weights")
    assert loading._unreadable_weights(folder).startswith("model.safetensors cannot be read")


def test_weights_of_other_shapes_than_the_config_are_refused_naming_the_config(capsys, tmp_path):
    # a config.json edited (or copied from another size) after the weights were saved: old code, a RuntimeError
    # traceback ("You set `ignore_mismatched_sizes` to `False`, thus raising an error")
    from transformers import AutoModelForCausalLM

    folder, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6]}\n')
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 2 * config["vocab_size"]}))
    assert main(["run", prompts, "--model", folder, "--out", tmp_path / "o.jsonl"]) == 2
    assert "its weights do not fit its config.json" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_weights_that_lack_tensors_of_the_model_are_refused_naming_them(capsys, tmp_path):
    """A folder saved by AutoModel (no LM head) or from another class: from_pretrained filled lm_head with random
    values, so each run of the same command gave other outputs (and a rerun refused its own records)."""
    from transformers import AutoModel

    folder, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6]}\n')
    torch.manual_seed(0)
    AutoModel.from_config(tiny_config("llama")).save_pretrained(str(folder))  # (untied embeddings: no lm_head)
    assert main(["run", prompts, "--model", folder, "--out", tmp_path / "o.jsonl"]) == 2
    err = capsys.readouterr().err
    assert f"error: --model '{folder}': its weights lack 1 of the model's tensors (lm_head.weight)" in err, err
    assert "['LlamaModel']" in err and "cannot build" not in err
    assert not (tmp_path / "o.jsonl").exists()
