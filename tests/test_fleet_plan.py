"""`prefixlab run --plan`: the assignment and per-process order a real run makes, with the scheduler's estimates,
without reading weights or writing anything."""

import json

import numpy as np
import pytest
import torch
from hf_models import config as tiny_config
from test_fleet_run import files, launch, needs_accelerate, read_out  # noqa: F401  (files: the module fixture)

import prefixlab.fleet.serve
from prefixlab.cli import main


def plan(capsys, prompts, model, out, *extra):
    code = main(["run", prompts, "--model", model, "--out", out, "--plan", "--json", *map(str, extra)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def served_steps(monkeypatch, prompts_of_run):
    """Patch serve.serve to record (process, ids in serve order, batches of ids) of the steps a run serves."""
    real, seen = prefixlab.fleet.serve.serve, []

    def recording(model, store, prompts, steps, write, **kwargs):
        ids = [prompts[i].id for index, length in steps if not length or isinstance(index, tuple)
               for i in (index if isinstance(index, tuple) else (index,))]
        batches = [[prompts[i].id for i in index] for index, _ in steps if isinstance(index, tuple)]
        seen.append((kwargs.get("process", 0), ids, batches))
        return real(model, store, prompts, steps, write, **kwargs)

    monkeypatch.setattr(prefixlab.fleet.serve, "serve", recording)
    return seen


@pytest.mark.parametrize("options", [(), ("--hydragen", "--max-batch", "3"), ("--order", "input")])
def test_the_plan_is_what_a_run_serves(capsys, monkeypatch, files, tmp_path, options):  # noqa: F811
    out = tmp_path / "out.jsonl"
    planned = plan(capsys, files / "prompts.jsonl", files / "config.json", out, *options)
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written: no OUT, part or lock file
    seen = served_steps(monkeypatch, files)
    assert main(["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", out, "--json",
                 *options]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (process, ids, batches), = seen
    mine = planned["per_process"][0]
    assert planned["processes"] == 1 and mine["ids"] == ids and mine["batch_ids"] == batches
    assert planned["pending"] == summary["requests"] == 12 and planned["prompt_tokens"] == summary["prompt_tokens"]
    # the store model's estimates are the run's counts here (nothing evicted; a prime's checkpoint where it is)
    for key, real in (("reused_tokens", "reused_tokens"), ("prefill_tokens", "prefilled_tokens"),
                      ("prime_tokens", "prime_tokens"), ("batches", "batches")):
        assert planned[key] == summary[real], key
    if "--hydragen" in options:
        assert planned["batching"] == "rows" and planned["batches"] == 3


def test_the_plan_reads_no_weights_and_leaves_out_what_out_holds(capsys, files, tmp_path):  # noqa: F811
    """A model folder whose weights are garbage plans all the same (only the config, on the meta device); the
    prompts OUT already holds are not planned, and a prompt changed since is refused as a rerun refuses it."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).save_pretrained(str(folder))
    whole = plan(capsys, files / "prompts.jsonl", folder, tmp_path / "a.jsonl", "--processes", "2")
    (folder / "model.safetensors").write_bytes(b"not weights")
    planned = plan(capsys, files / "prompts.jsonl", folder, tmp_path / "a.jsonl", "--processes", "2")
    assert planned == whole and planned["processes"] == 2 and all(p["prompts"] for p in planned["per_process"])
    out = tmp_path / "out.jsonl"
    three = tmp_path / "three.jsonl"
    three.write_text("".join((files / "prompts.jsonl").read_text().splitlines(keepends=True)[:3]))
    assert main(["run", three, "--model", files / "config.json", "--out", out]) == 0
    capsys.readouterr()
    planned = plan(capsys, files / "prompts.jsonl", files / "config.json", out)
    assert planned["resumed"] == 3 and planned["pending"] == 9 == planned["per_process"][0]["prompts"]
    assert not {r["id"] for r in read_out(out)} & set(planned["per_process"][0]["ids"])
    lines = (files / "prompts.jsonl").read_text().splitlines()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([json.dumps({**json.loads(lines[0]), "max_new_tokens": 2}), *lines[1:]]) + "\n")
    assert main(["run", edited, "--model", files / "config.json", "--out", out, "--plan"]) == 2
    assert "made from another prompt" in capsys.readouterr().err


def test_plan_text_and_bad_options(capsys, files, tmp_path):  # noqa: F811
    args = ["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", tmp_path / "o.jsonl"]
    assert main([*args, "--plan", "--processes", "3", "--routing", "round-robin"]) == 0
    text = capsys.readouterr().out
    assert "plan: 12 of 12 prompts to serve" in text and "process 2: 4 prompts" in text and "load imbalance" in text
    assert main([*args, "--processes", "2"]) == 2
    assert "--processes is for --plan" in capsys.readouterr().err
    assert main([*args, "--plan", "--routing", "sticky"]) == 2
    assert "round-robin" in capsys.readouterr().err and not list(tmp_path.iterdir())
    # (was "balance_eps must be ...", the router's argument, not the flag; inf was taken, where `simulate` refuses it:
    # every replica eligible however loaded, the balance bound gone)
    for eps in ("nan", "-1", "inf"):
        assert main([*args, "--plan", "--balance-eps", eps]) == 2
        assert f"--balance-eps {eps} must be a finite number >= 0" in capsys.readouterr().err


@needs_accelerate
def test_the_plan_is_what_two_launched_processes_serve(capsys, files, tmp_path):  # noqa: F811
    out = tmp_path / "out.jsonl"
    planned = plan(capsys, files / "prompts.jsonl", files / "config.json", out, "--processes", "2")
    done, summary = launch(files, out)
    assert done.returncode == 0 and summary["processes"] == 2, done.stderr[-3000:]
    served = {r["id"]: r["process"] for r in read_out(out)}
    assert served == {i: p["process"] for p in planned["per_process"] for i in p["ids"]}
    assert [g["prompt_tokens"] for g in summary["per_process"]] == [p["prompt_tokens"] for p in planned["per_process"]]


@pytest.mark.parametrize("world_size", ["abc", "0", "-2", "2.0", "²"])
def test_a_bad_world_size_is_a_clear_error(capsys, monkeypatch, files, tmp_path, world_size):  # noqa: F811
    """--plan without --processes plans for the launcher's WORLD_SIZE: 'abc' gave int()'s raw ValueError, 0 / -2
    "replicas must be a positive int", a word the command never uses."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    args = ["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", tmp_path / "o.jsonl", "--plan"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"WORLD_SIZE={world_size!r}" in err and "--processes" in err and "replicas" not in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan(capsys, *args[1:2], files / "config.json", tmp_path / "o.jsonl")["processes"] == 2


@pytest.mark.parametrize("policy", ["dp", "marconi", "sglang+"])
def test_the_store_model_resumes_what_a_real_store_resumes(policy):
    """The plan's model of a process's store (schedule.prefill: what run's affinity routing and the plan's estimates
    feed each prompt through) against a real PrefixStore serving the same prompts (one output token: nothing past
    the prompt is admitted): the same tokens resumed by every prompt. It replayed a prompt as Marconi's simulator
    does, without the state a store keeps before the prompt's last token, where a repeat resumes: a repeat of a
    29-token prompt resumed 26 tokens in the model, 28 in the store, and the other states held changed later hits
    both ways (dp: 10 of 17 prompts off under this budget)."""
    from hf_models import build
    from hf_models import tokens as random_tokens

    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.cache.store import PrefixStore
    from prefixlab.fleet import schedule, serve

    model = build("qwen3_5")
    spec = ModelSpec.from_config(model.config, dtype=model.dtype)
    capacity = 8 * spec.state_bytes + 300 * spec.kv_bytes_per_token
    rng = np.random.default_rng(0)
    bases = [random_tokens(40, seed=k).numpy() for k in range(3)]
    prompts = []
    for k in range(14):  # prompts branching off three shared bases, every fourth one repeated
        base = bases[rng.integers(0, 3)]
        prompts.append(np.concatenate([base[:rng.integers(10, 40)], rng.integers(3, 128, rng.integers(1, 6))]))
        prompts.extend([prompts[-1]] if k % 4 == 3 else [])
    core, store = schedule.StoreModel(policy, capacity, spec).core(), PrefixStore(model, capacity, policy=policy)
    try:
        with torch.inference_mode():
            real = [serve.generate(model, store, prompt, 1)[1] for prompt in prompts]
    finally:
        store.close()
    modelled = [len(prompt) - schedule.prefill(core, prompt) for prompt in prompts]
    assert modelled == real and sum(real) > 0


def test_the_plan_leaves_out_of_batches_the_prompts_a_run_serves_alone(capsys, monkeypatch, files, tmp_path):  # noqa: F811
    """Prompts with stop_token_ids under a generation config with min_new_tokens are served alone in a run
    (serve.served_alone: their stop ids would be EOS ids alone, not in a batch); the plan batched them."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_5"))
    model.generation_config.min_new_tokens = 2
    model.save_pretrained(str(folder))
    lines = [json.loads(line) for line in (files / "prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({**line, **({"stop_token_ids": [5]} if k % 2 else {})}) + "\n"
                               for k, line in enumerate(lines)))
    out = tmp_path / "out.jsonl"
    planned = plan(capsys, prompts, folder, out, "--hydragen")
    seen = served_steps(monkeypatch, prompts)  # (ids in step order: a run serves those alone first)
    assert main(["run", prompts, "--model", folder, "--out", out, "--json", "--hydragen"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (_, ids, _), = seen
    assert sorted(map(str, planned["per_process"][0]["ids"])) == sorted(map(str, ids))
    for key, real in (("batches", "batches"), ("batched_prompts", "batched_requests"),
                      ("reused_tokens", "reused_tokens"), ("prefill_tokens", "prefilled_tokens")):
        assert planned[key] == summary[real], key
    assert 0 < summary["batched_requests"] < 12
