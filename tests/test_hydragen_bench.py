"""`prefixlab bench hydragen` at tiny sizes: the fields it reports; both benches' errors (real runs: benchmarks/)."""

import json

import pytest
import torch

from prefixlab.bench.hydragen_e2e import bench_e2e
from prefixlab.cli import main
from prefixlab.errors import InvalidInputError


def test_cli_json_has_the_timings_and_speedup(capsys):
    code = main(["bench", "hydragen", "--batch", "3", "--prefix", "32", "--suffix", "4", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--no-packed", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"sdpa_ms", "split_ms", "packed_ms", "speedup"} <= result.keys()
    assert result["speedup"] == result["sdpa_ms"] / result["split_ms"] and result["packed_ms"] is None


def test_cli_sweeps_batch_and_prefix_lists_one_line_a_point_and_plots(capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    code = main(["bench", "hydragen", "--batch", "2,3", "--prefix", "16,32", "--suffix", "4", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--no-packed", "--json", "--plot",
                 str(plot)])
    assert code == 0
    points = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(p["prefix"], p["batch"]) for p in points] == [(16, 2), (16, 3), (32, 2), (32, 3)]
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["hydragen", "--batch", "0", "--no-packed"], "--batch=0 must be at least 1"),
    (["hydragen", "--batch", "64,x"], "--batch='64,x' must be a whole number or a comma-separated list"),
    (["hydragen", "--prefix", "128,0"], "--prefix=0 must be at least 1"),
    (["hydragen", "--plot", "sweep.txt"], "use a .png, .pdf or .svg file name"),
    (["hydragen", "--e2e", "--plot", "sweep.png"], "drop it with --e2e"),
    (["hydragen", "--head-dim", "0"], "--head-dim=0 must be at least 1"),
    (["hydragen", "--q-heads", "3", "--kv-heads", "2"], "multiple of --kv-heads=2"),
    (["hydragen", "--device", "tpu"], "not a torch device name"),
    (["hydragen", "--e2e", "--new-tokens", "0"], "--new-tokens=0 must be at least 1"),
    (["hydragen", "--e2e", "--device", "tpu"], "not a torch device name"),
    (["recurrent", "--length", "0"], "--length=0 must be at least 1"),
    (["recurrent", "--length", "64", "--captures", "65"], "must not exceed --length=64"),
    (["recurrent", "--ssd-state", "0"], "--ssd-state=0 must be at least 1"),
    (["recurrent", "--threads", "-1"], "--threads=-1 must be >= 0"),
    (["recurrent", "--device", "tpu"], "not a torch device name"),
    # meta tensors hold no data: the benchmarks "ran" and printed timings of nothing; mps / xpu crashed
    (["recurrent", "--device", "meta"], "--device 'meta': the benchmarks run on cpu or cuda"),
    (["recurrent", "--device", "mps"], "--device 'mps': the benchmarks run on cpu or cuda"),
    (["hydragen", "--device", "meta"], "--device 'meta': the benchmarks run on cpu or cuda"),
    (["recurrent", "--backend", "nope"], "backend must be one of"),
    (["recurrent", "--backend", "fla", "--device", "cpu"], "needs CUDA tensors"),
])
def test_cli_rejects_bad_sizes_before_running(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cli_says_there_is_no_cuda_device(capsys):
    for argv in (["hydragen"], ["hydragen", "--e2e"], ["recurrent"]):
        assert main(["bench", *argv, "--device", "cuda"]) == 2
        assert "no CUDA device; use --device cpu" in capsys.readouterr().err


def test_e2e_runs_all_three_and_hydragen_matches_standard():
    result = bench_e2e("llama", completions=2, prompt_tokens=12, new_tokens=2)
    assert result["same_tokens"]
    assert all(result[f"{run}_tok_s"] > 0 for run in ("standard", "hydragen", "no_attention"))


def test_e2e_runs_in_bf16_and_says_so():
    result = bench_e2e("qwen3_5", completions=2, prompt_tokens=12, new_tokens=2, device="cpu", dtype="bf16")
    assert (result["device"], result["dtype"]) == ("cpu", "bf16") and isinstance(result["same_tokens"], bool)
    assert all(result[f"{run}_tok_s"] > 0 for run in ("standard", "hydragen", "no_attention"))


def test_the_real_size_e2e_model_is_a_qwen3_5_hybrid_of_about_4b_parameters():
    """`--model qwen3_5_4b` (issue 12's end-to-end point at a real size, on a GPU): built on the meta device here."""
    from transformers import Qwen3_5ForCausalLM

    from prefixlab.bench.hydragen_e2e import qwen3_5_4b_config

    config = qwen3_5_4b_config()
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    assert 3.5e9 <= sum(p.numel() for p in model.parameters()) <= 4.5e9
    assert config.layer_types.count("full_attention") == 8 and config.layer_types[3] == "full_attention"


def test_e2e_refuses_an_unknown_model_and_the_4b_model_off_a_gpu():
    with pytest.raises(InvalidInputError, match="must be one of"):
        bench_e2e("gpt2", completions=2, prompt_tokens=12, new_tokens=2)
    with pytest.raises(InvalidInputError, match="for a GPU"):
        bench_e2e("qwen3_5_4b", completions=2, prompt_tokens=12, new_tokens=2, device="cpu")


def test_the_cpu_clock_counts_this_process_work_not_waiting():
    """`--clock cpu` (the benchmark bars' clock on a shared machine): time spent not computing does not count."""
    import time

    from prefixlab.bench.recurrent import best_times_s

    wait = {"wait": lambda: time.sleep(0.05)}
    assert best_times_s(wait, 1, clock="wall")["wait"] >= 0.05 > 0.02 > best_times_s(wait, 1, clock="cpu")["wait"]


def test_recurrent_bench_reports_the_backend_that_ran_for_one_token(capsys):
    """--backend auto over one token runs the token loop (a chunked kernel would pad it to a chunk); the report
    said backend=torch, resolving the name without the length as the kernels do not."""
    argv = ["bench", "recurrent", "--length", "1", "--captures", "1", "--heads", "1", "--dim", "4", "--ssd-heads",
            "1", "--ssd-head-dim", "2", "--ssd-state", "2", "--repeats", "1", "--backend", "auto", "--json"]
    assert main(argv) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["backend"] for r in results] == ["naive"] * 3
