"""`prefixlab run`: exact outputs in input order, resume, radix-order scheduling, bad input, 2 launched processes."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import config as tiny_config

import prefixlab.fleet.serve
from prefixlab.cli import main
from prefixlab.fleet import loading, outputs, serve
from prefixlab.fleet.launch import TEST_EXIT_AFTER
from prefixlab.fleet.prompts import read_prompts
from prefixlab.fleet.run import Stopped

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny hybrid's config.json and a shuffled file of 12 prompts over 3 shared 150-token prefixes."""
    folder = tmp_path_factory.mktemp("fleet")
    tiny_config("qwen3_5").to_json_file(folder / "config.json")
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 128, 150).tolist() for _ in range(3)]
    records = [{"id": f"p{k}" if k % 2 else k, "input_ids": prefixes[k % 3] + rng.integers(3, 128, 8).tolist(),
                "max_new_tokens": 3} for k in range(12)]
    with open(folder / "prompts.jsonl", "w") as file:
        file.writelines(json.dumps(records[i]) + "\n" for i in rng.permutation(12))
    return folder


@pytest.fixture(scope="module")
def reference(files):
    """id -> greedy output of the same model without prefixlab."""
    model = loading.load_model(str(files / "config.json"))
    with torch.inference_mode():
        return {p.id: serve.generate_uncached(model, p.tokens, p.max_new_tokens)
                for p in read_prompts(files / "prompts.jsonl")}


def run(capsys, files, out, *extra):
    code = main(["run", str(files / "prompts.jsonl"), "--model", str(files / "config.json"), "--out", str(out),
                 "--json", *map(str, extra)])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and code != 2 else None), captured.err


def read_out(path):
    with open(path) as lines:
        return [json.loads(line) for line in lines]


def test_run_is_exact_in_input_order_and_resumes(capsys, files, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    code, summary, _ = run(capsys, files, out)
    assert code == 0 and summary["requests"] == 12 and summary["lost"] == 0
    records = read_out(out)
    assert [r["id"] for r in records] == list(reference)  # the prompt file's order
    assert {r["id"]: r["output_ids"] for r in records} == reference
    assert summary["reused_tokens"] == sum(r["reused_tokens"] for r in records) > 0
    # every request has its reason; requests that reused tokens are hits (radix order primes every shared prefix)
    assert sum(summary["reasons"].values()) == 12
    assert summary["reasons"].get("hit", 0) == sum(r["reused_tokens"] > 0 for r in records) > 0
    assert summary["prompt_tokens"] == sum(len(p.tokens) for p in read_prompts(files / "prompts.jsonl"))
    before = out.read_bytes()
    code, summary, err = run(capsys, files, out)  # a rerun finds everything done and leaves OUT as it was
    assert code == 0 and summary["resumed"] == 12 and summary["requests"] == 0 and "resuming" in err
    assert out.read_bytes() == before


def test_interrupted_run_keeps_what_finished_and_a_rerun_completes_it(capsys, files, reference, tmp_path,
                                                                       monkeypatch):
    real, calls = serve.generate, []

    def dies_on_the_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise Stopped()  # what SIGTERM raises when the launcher stops the process group
        return real(*args, **kwargs)

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(prefixlab.fleet.serve, "generate", dies_on_the_fourth)
    code, summary, _ = run(capsys, files, out)
    assert code == 1 and summary["lost"] == 9 and len(read_out(out)) == 3
    monkeypatch.setattr(prefixlab.fleet.serve, "generate", real)
    code, summary, _ = run(capsys, files, out)
    assert code == 0 and summary["resumed"] == 3 and summary["requests"] == 9
    assert [(r["id"], r["output_ids"]) for r in read_out(out)] == list(reference.items())


def test_a_rerun_refuses_records_of_another_prompt_or_model(capsys, files, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run(capsys, files, out)[0] == 0
    before = out.read_bytes()
    assert main(["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", out, "--seed", "1"]) == 2
    assert "made from another prompt, max_new_tokens or model" in capsys.readouterr().err
    edited = tmp_path / "edited.jsonl"
    lines = (files / "prompts.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    edited.write_text("\n".join([json.dumps({**first, "max_new_tokens": 2}), *lines[1:]]) + "\n")
    assert main(["run", edited, "--model", files / "config.json", "--out", out]) == 2
    assert f"ids [{first['id']!r}]" in capsys.readouterr().err and out.read_bytes() == before


def test_a_rerun_refuses_records_of_a_config_with_the_same_weights(capsys, files, tmp_path):
    """Another rope_theta builds the same weights but other outputs: a rerun mixed the two models' records."""
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join((files / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    config = json.loads((files / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.jsonl"
    assert main(["run", prompts, "--model", files / "config.json", "--out", out, "--max-new-tokens", "1"]) == 0
    capsys.readouterr()
    assert main(["run", prompts, "--model", tmp_path / "config.json", "--out", out, "--max-new-tokens", "1"]) == 2
    assert "made from another prompt, max_new_tokens or model" in capsys.readouterr().err


def test_radix_order_prefills_fewer_tokens_than_input_order(capsys, files, tmp_path):
    prefilled = {}
    for order in ("radix", "input"):
        code, summary, _ = run(capsys, files, tmp_path / f"{order}.jsonl", "--order", order, "--policy", "marconi")
        assert code == 0
        prefilled[order] = summary["prefilled_tokens"]
    assert prefilled["input"] >= 1.5 * prefilled["radix"], prefilled


def test_hydragen_batches_the_siblings_of_each_prime_exactly(capsys, files, tmp_path):
    """A hybrid's siblings of different lengths and max_new_tokens: each row prefilled alone, decoded in one batch."""
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(3, 128, 150).tolist() for _ in range(3)]
    records = [{"id": k, "input_ids": prefixes[k % 3] + rng.integers(3, 128, 1 + k).tolist(),
                "max_new_tokens": 1 + k % 4} for k in range(12)]
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    shutil.copy(files / "config.json", ragged / "config.json")
    with open(ragged / "prompts.jsonl", "w") as file:
        file.writelines(json.dumps(records[i]) + "\n" for i in rng.permutation(12))
    model = loading.load_model(str(ragged / "config.json"))
    with torch.inference_mode():
        reference = {r["id"]: serve.generate_uncached(model, r["input_ids"], r["max_new_tokens"]) for r in records}
    plain = run(capsys, ragged, tmp_path / "radix.jsonl")[1]
    code, summary, _ = run(capsys, ragged, tmp_path / "out.jsonl", "--hydragen", "--max-batch", "3")
    assert code == 0
    assert {r["id"]: r["output_ids"] for r in read_out(tmp_path / "out.jsonl")} == reference
    # 3 primes of 150 tokens, each with 4 siblings: batches of 3 + 1 left to the plain path
    assert summary["batches"] == 3 and summary["batched_requests"] == 9 and summary["padding_tokens"] == 0
    assert summary["reasons"]["hydragen_batch"] == 9 and sum(summary["reasons"].values()) == 12
    for key in ("reused_tokens", "prefilled_tokens", "prime_tokens", "generated_tokens"):
        assert summary[key] == plain[key], key  # the same tokens computed, in fewer forward calls
    assert summary["kv_bytes_read"] < plain["kv_bytes_read"]
    assert main(["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", tmp_path / "x.jsonl",
                 "--hydragen", "--order", "input"]) == 2
    assert "--order radix" in capsys.readouterr().err


def test_bad_input(capsys, files, tmp_path):
    lines = (files / "prompts.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    args = ["--model", files / "config.json", "--out", tmp_path / "o.jsonl"]
    assert main(["run", bad, *args]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()
    assert main(["run", bad, *args, "--on-error", "skip", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["requests"] == 2
    for content, message in (([lines[0], lines[0]], "duplicate id"), (['{"id": 1, "text": "hi"}'], "tokenizer"),
                             (['{"id": 1, "input_ids": [1, 999]}'], "vocabulary"),
                             ([json.dumps({"id": 1, "input_ids": [1] * 505, "max_new_tokens": 8})], "context of 512"),
                             (['{"id": 1, "input_ids": [1], "stop_sequences": ["x"]}'], "unknown keys")):
        bad.write_text("\n".join(content) + "\n")
        assert main(["run", bad, *args[:2], "--out", tmp_path / "x.jsonl"]) == 2
        assert message in capsys.readouterr().err
    bad.write_bytes(lines[0].encode() + b'\n{"id": "x", "input_ids": [1, 2], "\xff": 1}\n')  # not UTF-8
    assert main(["run", bad, *args[:2], "--out", tmp_path / "x.jsonl"]) == 2
    assert f"{bad}:2: 'utf-8' codec can't decode" in capsys.readouterr().err
    bad.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")  # a BOM, as some editors save
    assert main(["run", bad, *args[:2], "--out", tmp_path / "bom.jsonl", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["requests"] == 12
    assert main(["run", files / "prompts.jsonl", *args, "--routing", "sticky"]) == 2
    assert "round-robin" in capsys.readouterr().err
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text("my notes\n")
    assert main(["run", files / "prompts.jsonl", *args[:2], "--out", foreign]) == 2
    assert "not a prefixlab run output" in capsys.readouterr().err and foreign.read_text() == "my notes\n"
    assert main(["run", bad, *args[:2], "--out", bad]) == 2  # its lines were taken as finished records
    assert "is the prompt file" in capsys.readouterr().err and bad.read_bytes().startswith(b"\xef\xbb\xbf")
    assert main(["run", files / "prompts.jsonl", *args[:2], "--out", tmp_path]) == 2  # checked before any work
    assert "is a folder" in capsys.readouterr().err and not list(tmp_path.glob("*.part*"))
    busy = tmp_path / "busy.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               f"{busy}.lock"], stdout=subprocess.PIPE, text=True)
    try:  # another run holds OUT
        assert holder.stdout.readline().strip() == "held"
        assert main(["run", files / "prompts.jsonl", *args[:2], "--out", busy]) == 2
        assert "being written by another prefixlab run" in capsys.readouterr().err and not busy.exists()
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(SystemExit, match="2"):
        main(["run", files / "prompts.jsonl", *args, "--seed", "-1"])
    assert "--seed: must be an integer in [0, 2**63)" in capsys.readouterr().err


LAUNCHER = os.path.join(os.path.dirname(sys.executable), "accelerate")
needs_accelerate = pytest.mark.skipif(not os.path.exists(LAUNCHER), reason="accelerate (the dist extra) is missing")


def _free_port() -> int:
    """A loopback port free now (a fixed one may be taken on a CI machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(files, out, *launch_options, env: dict | None = None, run_options=(), prompts=None):
    """`accelerate launch` 2 CPU processes of `prefixlab run --json` on the tiny file: (completed process, the last
    stdout line as JSON or None). On a CPU-only machine --multi_gpu starts the processes on gloo (accelerate's --cpu
    launch starts only one)."""
    command = [LAUNCHER, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
               "no", "--dynamo_backend", "no", "--main_process_port", _free_port(), *launch_options, "-m", "prefixlab",
               "run", prompts or files / "prompts.jsonl", "--model", files / "config.json", "--out", out, "--cpu",
               "--json", *run_options]
    env = {**{key: value for key, value in os.environ.items() if key != TEST_EXIT_AFTER},
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(out.parent), **(env or {})}  # torchrun's log folder (torchelastic_*) is never removed
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done, (json.loads(lines[-1]) if lines else None)


@needs_accelerate
def test_two_launched_processes(files, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    done, summary = launch(files, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["processes"] == 2 and summary["requests"] == 12 and summary["lost"] == 0
    assert summary["restarts"] == 0 and summary["prefill_seconds"] > 0
    per_process = [g["prompt_tokens"] for g in summary["per_process"]]
    assert all(per_process) and sum(per_process) == sum(len(p.tokens) for p in read_prompts(files / "prompts.jsonl"))
    records = read_out(out)
    assert [(r["id"], r["output_ids"]) for r in records] == list(reference.items())
    assert {r["process"] for r in records} == {0, 1} and not list(tmp_path.glob("out.jsonl.part*"))
    assert list(tmp_path.glob("torchelastic_*"))  # the launcher's leftover log folder went to tmp_path, not /tmp


@needs_accelerate
def test_fewer_prompts_than_processes(files, reference, tmp_path):
    """One prompt for two processes: the other has nothing to do (it was refused outright before)."""
    one, out = tmp_path / "one.jsonl", tmp_path / "out.jsonl"
    one.write_text((files / "prompts.jsonl").read_text().splitlines()[0] + "\n")
    done, summary = launch(files, out, prompts=one)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 prompts for 2 processes" in done.stderr
    assert summary["processes"] == 2 and summary["requests"] == 1 and summary["lost"] == 0
    first = next(iter(reference))
    assert [(r["id"], r["output_ids"]) for r in read_out(out)] == [(first, reference[first])]


@needs_accelerate
def test_an_out_the_main_process_refuses_stops_every_process_with_its_error(files, reference, tmp_path):
    """The main process alone reads OUT and plans; when it refused OUT (a line that is not JSON, records of
    another prompt file) the others, waiting for its plan, died of gloo's 'Connection closed by peer' with a raw
    traceback each. Now the plan carries the error: every process stops with it, no traceback."""
    out = tmp_path / "out.jsonl"
    first = json.dumps({"id": next(iter(reference)), "output_ids": [1]})
    out.write_text(first + "\n" + '{"id": "broken\n')
    done, summary = launch(files, out)
    assert done.returncode != 0 and summary is None
    assert "out.jsonl:2 is not a JSON line" in done.stderr, done.stderr[-3000:]
    # (the launcher's own traceback for a failed child stays, as for any run that fails)
    assert "[rank" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("is not a JSON line") == 2  # one line from each process
    assert out.read_text() == first + "\n" + '{"id": "broken\n'  # left as it was
    # an option only the main process's planning read (the router's --balance-eps) did the same
    done, summary = launch(files, tmp_path / "other.jsonl", run_options=("--balance-eps", "nan"))
    assert done.returncode != 0 and summary is None
    assert done.stderr.count("--balance-eps nan must") == 2, done.stderr[-3000:]
    assert "[rank" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]


@needs_accelerate
def test_a_process_killed_mid_run(files, reference, tmp_path):
    """PREFIXLAB_TEST_EXIT_AFTER=<rank>:<n> (a test hook, prefixlab/fleet/launch.py) makes process <rank> SIGKILL
    itself after writing n records, on a launch's first attempt only. Without --max_restarts the launcher stops the
    other process: it keeps what it wrote, the summary lists the prompts lost, and a rerun completes them. With
    --max_restarts 1 the launcher restarts the group, which finishes the run in the same command."""
    out = tmp_path / "out.jsonl"
    # process 1 serves 4 of the 12 prompts and dies after 1; process 0 is stopped wherever it is
    done, summary = launch(files, out, env={TEST_EXIT_AFTER: "1:1"})
    assert done.returncode != 0 and summary is not None, done.stderr[-3000:]
    kept = outputs.finished(out)
    assert summary["stopped"] and summary["lost"] == 12 - len(kept) >= 3 and len(kept) >= 1, (summary, list(kept))
    assert set(summary["lost_ids"]) == set(reference) - set(kept)
    assert all(kept[i]["output_ids"] == reference[i] for i in kept)
    # the rerun resumes what was kept; now the main process dies after 1 record (round-robin gives it at least 2 of
    # the 3 or more prompts left) and the launcher restarts the group
    done, summary = launch(files, out, "--max_restarts", "1", env={TEST_EXIT_AFTER: "0:1"},
                           run_options=("--routing", "round-robin"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["restarts"] == 1 and summary["lost"] == 0 and "restart 1" in done.stderr, done.stderr[-3000:]
    assert summary["resumed"] >= len(kept) + 1 and summary["resumed"] + summary["requests"] == 12, summary
    assert summary["lost_at_failure"] == summary["redone"] == summary["requests"] > 0, summary
    assert [(r["id"], r["output_ids"]) for r in read_out(out)] == list(reference.items())  # each id once, in order
    assert not list(tmp_path.glob("out.jsonl.part*"))


def test_plain_loop_is_the_uncached_reference(files, reference):
    model = loading.load_model(str(files / "config.json"))
    stats = serve.ProcessStats()
    prompts = read_prompts(files / "prompts.jsonl")
    assert serve.serve_plain(model, prompts, stats) == reference
    assert stats.requests == 12 and stats.prefilled_tokens == stats.prompt_tokens == sum(len(p.tokens) for p in prompts)
    assert 0 < stats.prefill_seconds < stats.seconds


def test_text_prompts_with_a_tokenizer_file(capsys, files, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", *"the a library opens at nine closes late on sunday and monday ?".split()]
    tokenizer = Tokenizer(models.WordLevel({w: i + 3 for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "text": f"the library opens at nine on {day} ?"}) + "\n"
                               for k, day in enumerate(["sunday", "monday"])))
    out = tmp_path / "out.jsonl"
    code = main(["run", prompts, "--model", files / "config.json", "--out", out, "--tokenizer",
                 tmp_path / "tokenizer.json", "--max-new-tokens", "2"])
    assert code == 0 and "2 of 2" in capsys.readouterr().out
    records = read_out(out)
    assert [r["prompt_tokens"] for r in records] == [8, 8]
    assert [r["text"] for r in records] == [tokenizer.decode(r["output_ids"]) for r in records]
    # a rerun without the tokenizer (or with another) would write records without (or with other) text beside them
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"id": k, "input_ids": [3, 4, 5]}) + "\n" for k in range(2)))
    ids_out, half = tmp_path / "ids_out.jsonl", tmp_path / "half.jsonl"
    half.write_text(ids.read_text().splitlines(keepends=True)[0])
    args = ["--model", files / "config.json", "--out", ids_out, "--max-new-tokens", "1"]
    assert main(["run", half, *args, "--tokenizer", tmp_path / "tokenizer.json"]) == 0
    capsys.readouterr()
    assert main(["run", ids, *args]) == 2
    assert "(or --tokenizer)" in capsys.readouterr().err and len(read_out(ids_out)) == 1


def test_the_first_token_clock_waits_for_the_gpu_before_reading_the_time(monkeypatch):
    # CUDA kernels run asynchronously: a clock read when the host reaches the first logits times only the launches
    # (session 22's GPU prefill times were such host times)
    import types

    from prefixlab.fleet.serve import FirstTokenClock

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    monkeypatch.setattr("prefixlab.fleet.serve.time.perf_counter", lambda: events.append(("clock", None)) or 1.0)
    scores = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    clock = FirstTokenClock()
    assert clock(None, scores) is scores and clock(None, scores) is scores
    assert events == [("sync", "cuda:0"), ("clock", None)]  # once, before the clock; later steps untouched
