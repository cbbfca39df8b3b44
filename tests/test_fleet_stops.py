"""`prefixlab run` with per-prompt stop conditions: `stop_token_ids` and `stop` strings end each output where the
uncached model's `generate(eos_token_id=[...], stop_strings=..., tokenizer=...)` ends it, token for token, alone or
in a Hydragen sibling batch; records say why generation ended; changed stop options are refused on a rerun; bad
options are bad lines."""

import json

import numpy as np
import pytest
import torch
from hf_models import config as tiny_config
from test_fleet_run import read_out

from prefixlab.cli import main
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import loading, serve
from prefixlab.fleet.prompts import read_prompts
from prefixlab.fleet.stops import finish_reason
from prefixlab.fleet.tokenizer import PromptTokenizer

NEW = 8


def word_tokenizer(folder):
    """A word-level transformers tokenizer with a word for every id of the tiny models' vocabulary (128), so every
    output decodes; "abcdef" is a word (transformers' stop-string matcher renders tokens after it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[UNK]": 0, "abcdef": 1, **{f"t{k}": k for k in range(2, 128)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny hybrid's config, a tokenizer folder, the model and 8 prompts over one 60-token prefix with their greedy
    outputs (no stops)."""
    folder = tmp_path_factory.mktemp("stops")
    tiny_config("qwen3_5").to_json_file(folder / "config.json")
    word_tokenizer(folder / "tokenizer")
    model = loading.load_model(str(folder / "config.json"))
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 128, 60).tolist()
    prompts = [prefix + rng.integers(3, 128, 4 + k % 3).tolist() for k in range(8)]
    with torch.inference_mode():
        greedy = [serve.generate_uncached(model, p, NEW) for p in prompts]
    return folder, model, prompts, greedy


def reference(model, tokens, stop_token_ids=(), stop=(), hf=None, seed=None):
    """transformers' generate without prefixlab, given the stop options directly (sampled at temperature 1 from
    `seed` if given)."""
    options = {"eos_token_id": [2, *stop_token_ids]} if stop_token_ids else {}
    if stop:
        options |= {"stop_strings": list(stop), "tokenizer": hf}
    if seed is not None:
        options |= {"do_sample": True, "temperature": 1.0}
        torch.manual_seed(seed)
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, pad_token_id=0,
                             **({"do_sample": False} | options))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("hydragen", [False, True])
def test_stops_end_outputs_where_generate_ends_them(capsys, setup, tmp_path, hydragen):
    folder, model, prompts, greedy = setup
    hf = PromptTokenizer(folder / "tokenizer").hf
    lines = [
        {"stop_token_ids": [greedy[0][2]]},  # stops after its 3rd token (or earlier, where it came before)
        {"stop_token_ids": [greedy[1][3], 127 if 127 not in greedy[1] else 126]},
        {"stop_token_ids": [t for t in range(3, 128) if t not in greedy[2]][:2]},  # never generated: length
        {"stop": hf.decode(greedy[3][3:5])},  # two words: a string over two tokens
        {"stop": [hf.decode(greedy[4][1:2]), "t1t1"], "stop_token_ids": [greedy[4][5]]},
        {},  # no stop options: length (the tiny model never emits its EOS here)
        {"stop": hf.decode([prompts[6][-1], greedy[6][0]])},  # begins in the prompt: stops after one token
        {"temperature": 1.0, "seed": 4, "stop_token_ids": list(range(3, 60))},  # sampled, with its stops
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": k, "input_ids": p, "max_new_tokens": NEW, **line}) + "\n"
                            for k, (p, line) in enumerate(zip(prompts, lines, strict=True))))
    out = tmp_path / "out.jsonl"
    code = main(["run", path, "--model", folder / "config.json", "--tokenizer", folder / "tokenizer", "--out", out,
                 "--json", *(["--hydragen", "--max-batch", "4"] if hydragen else [])])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["reused_tokens"] > 0
    if hydragen:  # the stop-token-id siblings batch together; stop-string prompts are served alone
        assert summary["batched_requests"] >= 2
    records = read_out(out)
    for k, (record, line) in enumerate(zip(records, lines, strict=True)):
        stop = [line["stop"]] if isinstance(line.get("stop"), str) else line.get("stop", [])
        expected = reference(model, prompts[k], line.get("stop_token_ids", []), stop, hf, line.get("seed"))
        assert record["output_ids"] == expected, k
        assert record["text"] == hf.decode(expected)
    reasons = [r["finish_reason"] for r in records]
    sampled = records[7]["output_ids"]
    assert reasons == ["stop", "stop", "length", "stop", "stop", "length", "stop",
                       "stop" if 3 <= sampled[-1] < 60 else "length"], reasons
    assert len(records[6]["output_ids"]) == 1 and sampled != greedy[7][:len(sampled)]
    assert summary["finish_reasons"] == {why: reasons.count(why) for why in set(reasons)}
    assert len(records[0]["output_ids"]) <= 3 and records[0]["output_ids"][-1] == greedy[0][2]  # the stop id kept
    assert hf.decode(greedy[3][3:5]) in records[3]["text"] and len(records[3]["output_ids"]) <= 5  # the string kept
    assert len(records[4]["output_ids"]) <= 2  # the first of its stops that came


def test_a_model_eos_is_reported_as_eos(capsys, setup, tmp_path):
    folder, _, prompts, greedy = setup
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = greedy[0][2]  # the model's own EOS: generate stops there without any stop option
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": 0, "input_ids": prompts[0], "max_new_tokens": NEW}) + "\n" +
                    json.dumps({"id": 1, "input_ids": prompts[0], "max_new_tokens": NEW,
                                "stop_token_ids": [greedy[0][1]]}) + "\n")
    assert main(["run", path, "--model", tmp_path / "config.json", "--out", tmp_path / "out.jsonl"]) == 0
    capsys.readouterr()
    first, second = read_out(tmp_path / "out.jsonl")
    assert first["finish_reason"] == "eos" and first["output_ids"][-1] == greedy[0][2]
    assert second["finish_reason"] == "stop" and len(second["output_ids"]) <= 2  # (its own stop id comes first)


def test_finish_reason():
    assert finish_reason([5, 6, 7], 3, [2]) == "length"
    assert finish_reason([5, 2], 3, [2]) == "eos"
    assert finish_reason([5, 9], 3, [2], (9,)) == "stop"
    assert finish_reason([5, 2], 3, [2], (2,)) == "stop"  # (a stop id the user gave wins)
    assert finish_reason([5, 6], 3, [2], (), lambda: False) == "stop"  # ended early on no id: a stop string
    assert finish_reason([5, 6, 7], 3, [2], (), lambda: True) == "stop"
    assert finish_reason([5, 6, 7], 3, [2], (), lambda: False) == "length"


def test_changed_stop_options_are_refused_on_rerun_and_none_keep_the_fingerprint(capsys, setup, tmp_path):
    folder = setup[0]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6, 7], "stop_token_ids": [9]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", path, "--model", folder / "config.json", "--out", out, "--max-new-tokens", "2"]) == 0
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6, 7], "stop_token_ids": [10]}) + "\n")
    assert main(["run", path, "--model", folder / "config.json", "--out", out, "--max-new-tokens", "2"]) == 2
    assert "made from another prompt" in capsys.readouterr().err  # (... "or with other sampling or stop options")
    path.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "a", "input_ids": [5, 6]}, {"id": "b", "input_ids": [5, 6], "stop_token_ids": [], "stop": []},
        {"id": "c", "input_ids": [5, 6], "stop_token_ids": [9, 8, 9]}, {"id": "d", "input_ids": [5, 6],
                                                                         "stop_token_ids": [8, 9]},
        {"id": "e", "input_ids": [5, 6], "stop": "t9"}, {"id": "f", "input_ids": [5, 6], "stop": ["t9", "t9"]}]))
    a, b, c, d, e, f = read_prompts(path, PromptTokenizer(folder / "tokenizer"))
    assert a.fingerprint == b.fingerprint and c.fingerprint == d.fingerprint != a.fingerprint
    assert c.stop_token_ids == (8, 9) and e.fingerprint == f.fingerprint != a.fingerprint


@pytest.mark.parametrize(("options", "message"), [
    ({"stop_token_ids": 5}, r"'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": [1.5]}, r"'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": [-1]}, r"'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": [True]}, r"'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": [5, 128]}, r"stop token id 128 is outside the model's vocabulary \(128\)"),
    ({"stop": ""}, "'stop' strings must not be empty"),
    ({"stop": ["t5", ""]}, "'stop' strings must not be empty"),
    ({"stop": 5}, "'stop' must be a string or a list of strings"),
    ({"stop": ["t5", 3]}, "'stop' must be a string or a list of strings"),
    ({"stop": None}, "'stop' must be a string or a list of strings"),
    ({"stop": "\u00e9\u00e9"}, "transformers cannot match 'stop'"),  # a character no token has
])
def test_bad_stop_options_name_the_line(setup, tmp_path, options, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 0, "input_ids": [5, 6]}) + "\n" +
                    json.dumps({"id": 1, "input_ids": [5, 6], **options}) + "\n")
    tokenizer = PromptTokenizer(setup[0] / "tokenizer")
    with pytest.raises(InvalidInputError, match=rf"p.jsonl:2: {message}"):
        read_prompts(path, tokenizer, vocab_size=128)
    assert [p.id for p in read_prompts(path, tokenizer, vocab_size=128, on_error="skip")] == [0]


def test_stop_strings_need_a_tokenizer(capsys, setup, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6], "stop": "t5"}) + "\n")
    assert main(["run", path, "--model", setup[0] / "config.json", "--out", tmp_path / "out.jsonl"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: 'stop' strings need a tokenizer" in err and "--tokenizer" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_stop_strings_with_a_tokenizers_json_file(capsys, setup, tmp_path):
    """A tokenizers JSON file (no transformers folder): its strings are matched through PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    folder, model, prompts, greedy = setup
    json_file = folder / "tokenizer" / "tokenizer.json"
    path = tmp_path / "p.jsonl"
    stop = PromptTokenizer(json_file).decode(greedy[0][2:4])
    path.write_text(json.dumps({"id": 1, "input_ids": prompts[0], "max_new_tokens": NEW, "stop": stop}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", path, "--model", folder / "config.json", "--tokenizer", json_file, "--out", out]) == 0
    capsys.readouterr()
    record = read_out(out)[0]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(json_file))
    assert record["output_ids"] == reference(model, prompts[0], stop=[stop], hf=hf)
    assert record["finish_reason"] == "stop" and len(record["output_ids"]) <= 4


@pytest.mark.parametrize("plan", [False, True], ids=["run", "plan"])
def test_stop_strings_in_the_models_generation_config_are_refused_with_what_to_do(capsys, setup, tmp_path, plan):
    """A model folder whose generation_config.json names stop_strings failed every prompt with transformers'
    ValueError traceback ("could not locate a tokenizer"); with a tokenizer it would stop every row of a sibling
    batch on its padding and report "length". run takes stop strings per line."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_5"))
    model.generation_config.stop_strings = ["t5"]
    model.save_pretrained(str(tmp_path / "model"))
    word_tokenizer(tmp_path / "model")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6]}) + "\n")
    code = main(["run", path, "--model", tmp_path / "model", "--out", tmp_path / "out.jsonl",
                 *(["--plan"] if plan else [])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out.jsonl").exists(), err
    assert "its generation_config.json sets stop_strings ['t5']" in err and "\"stop\"" in err, err
