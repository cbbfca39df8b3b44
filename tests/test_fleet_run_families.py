"""`prefixlab run` on families whose generate or attention differs from the common case: Mamba2 (cache as
cache_params=), Inkling (attention hydragen cannot batch), GLM-5-Next (a vision-language generating class)."""

import json

import numpy as np
import pytest
import torch
from hf_models import config as tiny_config
from test_fleet_run import read_out, run

from prefixlab.fleet import loading, serve
from prefixlab.fleet.prompts import read_prompts


def family_file(tmp_path, family: str, seed: int, prefix_tokens: int, own_tokens: int, count: int) -> None:
    """A tiny `family` model's config.json and `count` prompts sharing a `prefix_tokens` prefix, in `tmp_path`."""
    tiny_config(family).to_json_file(tmp_path / "config.json")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 120, prefix_tokens).tolist()
    with open(tmp_path / "prompts.jsonl", "w") as file:
        file.writelines(json.dumps({"id": k, "input_ids": prefix + rng.integers(3, 120, own_tokens).tolist(),
                                    "max_new_tokens": 2}) + "\n" for k in range(count))


def check_outputs_uncached(tmp_path) -> torch.nn.Module:
    """Assert the run's outputs are the model's uncached greedy ones, in input order; returns the model."""
    model = loading.load_model(str(tmp_path / "config.json"))
    with torch.inference_mode():
        assert all(r["output_ids"] == serve.generate_uncached(model, p.tokens, 2)
                   for r, p in zip(read_out(tmp_path / "out.jsonl"), read_prompts(tmp_path / "prompts.jsonl"),
                                   strict=True))
    return model


@pytest.mark.parametrize("hydragen", [False, True])
def test_a_model_that_takes_its_cache_as_cache_params(capsys, tmp_path, hydragen):
    """Mamba2 takes its cache as cache_params= (generate refused past_key_values=: every run failed)."""
    family_file(tmp_path, "mamba2", seed=1, prefix_tokens=60, own_tokens=4, count=4)
    code, summary, _ = run(capsys, tmp_path, tmp_path / "out.jsonl", *(["--hydragen"] if hydragen else []))
    assert code == 0 and summary["reused_tokens"] > 0
    check_outputs_uncached(tmp_path)


@pytest.mark.parametrize("family", ["inkling", "inkling2"])
def test_hydragen_on_a_model_it_cannot_batch_serves_one_by_one(capsys, tmp_path, family):
    """Inkling's attention adds a position bias (Inkling2's sinks too), which hydragen attention refuses: --hydragen
    notes that it serves prompts one by one, so they run the model's own attention (every run failed)."""
    family_file(tmp_path, family, seed=2, prefix_tokens=12, own_tokens=2, count=3)
    code, summary, err = run(capsys, tmp_path, tmp_path / "out.jsonl", "--hydragen")
    assert code == 0 and "serving prompts one by one" in err and summary["reused_tokens"] > 0
    check_outputs_uncached(tmp_path)


def test_a_model_whose_generating_class_is_its_vision_language_one(capsys, tmp_path):
    """GLM-5-Next has no AutoModelForCausalLM class, only Glm5NextForConditionalGeneration: --model refused it."""
    family_file(tmp_path, "glm5_next", seed=3, prefix_tokens=16, own_tokens=3, count=3)
    code, summary, _ = run(capsys, tmp_path, tmp_path / "out.jsonl")
    assert code == 0 and summary["reused_tokens"] > 0
    assert type(check_outputs_uncached(tmp_path)).__name__ == "Glm5NextForConditionalGeneration"


@pytest.mark.parametrize("family", ["zamba2", "qwen3_5"])
def test_a_config_saved_with_use_cache_false_is_served_with_the_cache(capsys, tmp_path, family):
    """A config.json saved by a training run often says "use_cache": false: every run of Zamba2 / Nemotron-H (whose
    decode steps differ from prefills) stopped with "pass use_cache=True, or no cache", which the command line cannot
    pass; other families re-fed the whole sequence at every step."""
    family_file(tmp_path, family, seed=4, prefix_tokens=30, own_tokens=3, count=3)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"use_cache": False}))
    code, summary, _ = run(capsys, tmp_path, tmp_path / "out.jsonl")
    assert code == 0 and summary["reused_tokens"] > 0
    check_outputs_uncached(tmp_path)
