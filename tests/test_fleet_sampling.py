"""`prefixlab run` with sampled prompts: each prompt's draws come from its own seed, so its output is the uncached
model's with that seed whatever the cache reused, the batching around it and the order it was served in."""

import json

import numpy as np
import pytest
import torch
from test_fleet_run import files, read_out, run  # noqa: F401  (files: the module fixture)

from prefixlab.errors import InvalidInputError
from prefixlab.fleet import loading, serve
from prefixlab.fleet.prompts import read_prompts


def sampled_file(path, prefix, rng):
    """Nine prompts over one prefix: three copies of one prompt with seeds 1-3, and six with own tails, sampled
    (top_p or top_k on some) or greedy."""
    same = prefix + rng.integers(3, 128, 4).tolist()
    lines = [{"id": f"s{seed}", "input_ids": same, "temperature": 1.5, "seed": seed} for seed in (1, 2, 3)]
    for k in range(6):
        options = [{"temperature": 0.9, "top_p": 0.9}, {"temperature": 1.2, "top_k": 20}, {}][k % 3]
        lines.append({"id": k, "input_ids": prefix + rng.integers(3, 128, 3 + k).tolist(), **options})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("hydragen", [False, True])
def test_sampled_outputs_are_the_uncached_models_with_the_same_seed(capsys, files, tmp_path, hydragen):  # noqa: F811
    (tmp_path / "config.json").write_bytes((files / "config.json").read_bytes())
    prefix = np.random.default_rng(5).integers(3, 128, 90).tolist()
    sampled_file(tmp_path / "prompts.jsonl", prefix, np.random.default_rng(6))
    code, summary, _ = run(capsys, tmp_path, tmp_path / "out.jsonl", "--max-new-tokens", "6",
                           *(["--hydragen"] if hydragen else []))
    assert code == 0 and summary["reused_tokens"] > 0
    records = {r["id"]: r for r in read_out(tmp_path / "out.jsonl")}
    model = loading.load_model(str(tmp_path / "config.json"))
    state = torch.random.get_rng_state()
    with torch.inference_mode():
        for prompt in read_prompts(tmp_path / "prompts.jsonl", max_new_tokens=6):
            expected = serve.generate_uncached(model, prompt.tokens, 6, prompt.sampling)
            assert records[prompt.id]["output_ids"] == expected, prompt.id
    assert torch.equal(torch.random.get_rng_state(), state)  # (the process's own generator is left alone)
    assert len({tuple(records[f"s{seed}"]["output_ids"]) for seed in (1, 2, 3)}) > 1  # sampled, not greedy
    assert all(records[f"s{seed}"]["reused_tokens"] > 0 for seed in (2, 3))  # (one store holds their prompt)


def test_a_seed_changed_for_a_finished_prompt_is_refused_on_rerun(capsys, files, tmp_path):  # noqa: F811
    (tmp_path / "config.json").write_bytes((files / "config.json").read_bytes())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 1, "input_ids": [5, 6, 7], "temperature": 1.0, "seed": 1}) + "\n")
    assert run(capsys, tmp_path, tmp_path / "out.jsonl")[0] == 0
    prompts.write_text(json.dumps({"id": 1, "input_ids": [5, 6, 7], "temperature": 1.0, "seed": 2}) + "\n")
    code, _, err = run(capsys, tmp_path, tmp_path / "out.jsonl")
    assert code == 2 and "made from another prompt" in err


def test_a_greedy_prompt_keeps_its_fingerprint_and_a_sampled_ones_seed_defaults_from_its_id(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "a", "input_ids": [5, 6]}, {"id": "b", "input_ids": [5, 6], "temperature": 0},
        {"id": "c", "input_ids": [5, 6], "temperature": 1}, {"id": "d", "input_ids": [5, 6], "temperature": 1}]))
    a, b, c, d = read_prompts(path)
    assert a.sampling == b.sampling == () and a.fingerprint == b.fingerprint
    assert dict(c.sampling)["seed"] != dict(d.sampling)["seed"] and c.fingerprint != a.fingerprint
    assert read_prompts(path)[2].sampling == c.sampling  # (the same seed on every read: every process, rerun)


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": -1}, "'temperature' must be a number >= 0"),
    ({"temperature": True}, "'temperature' must be a number >= 0"),
    ({"temperature": float("nan")}, "'temperature' must be a number >= 0"),
    ({"temperature": 1e-40}, "'temperature' 1e-40 is below float32's smallest normal number; use 0 for greedy"),
    ({"temperature": 1, "top_p": 0}, r"'top_p' must be a number in \(0, 1\]"),
    ({"temperature": 1, "top_k": -1}, r"'top_k' must be an int in \[0, 2\*\*63\)"),
    ({"temperature": 1, "seed": 1.5}, r"'seed' must be an int"),
    ({"top_p": 0.9}, "'top_p' apply to sampling: give 'temperature' > 0"),
    ({"seed": 3}, "'seed' apply to sampling"),
])
def test_bad_sampling_options_name_the_line(tmp_path, options, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6], **options}) + "\n")
    with pytest.raises(InvalidInputError, match=rf"p.jsonl:1: {message}"):
        read_prompts(path)


def test_a_seeded_prompt_draws_as_transformers_after_manual_seed_and_leaves_other_devices_alone(
        files, monkeypatch):  # noqa: F811
    """The draws are those of `torch.manual_seed(seed)` then `generate`, but only the generators they use are
    seeded (and restored): torch.manual_seed would reseed every GPU of the process, not only the model's."""
    model = loading.load_model(str(files / "config.json"))
    tokens, sampling = [5, 9, 11, 40], (("temperature", 1.5), ("seed", 7))
    torch.manual_seed(7)
    expected = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                              max_new_tokens=6, do_sample=True, temperature=1.5, pad_token_id=0)[0, 4:].tolist()
    seeded_all = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded_all.append)
    assert serve.generate_uncached(model, tokens, 6, sampling) == expected
    assert not seeded_all
