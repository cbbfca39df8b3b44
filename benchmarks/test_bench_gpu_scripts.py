"""The GPU session's scripts (benchmarks/gpu_check.sh) at CPU size, so they work when a GPU is lent: the
serve-vs-plain benchmark and the per-request profile, on a tiny model and a few prompts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def run(*argv: str, code: int = 0) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=HERE, capture_output=True, text=True, timeout=600)
    assert done.returncode == code, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_serve_accelerate_against_a_plain_loop_one_process():
    out = run("serve_accelerate.py", "--cpu", "--baseline", "--system-prompts", "2", "--questions", "2",
              "--prompt-tokens", "96", "--max-new-tokens", "2", "--routing", "affinity", "--order", "input,radix",
              "--json")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["order"] for r in rows] == ["input", "radix"]
    for row in rows:
        assert row["outputs_identical"] and row["in_input_order"] and row["requests"] == 4
        assert row["plain"]["requests"] == 4 and row["throughput_vs_plain"] > 0
    assert rows[1]["prefilled_tokens"] <= rows[0]["prefilled_tokens"]
    # the prompt trie's size is a floor no order goes under (radix order reaches it up to the last-token rule)
    assert 0 < rows[1]["prompt_trie_tokens"] <= rows[1]["prefilled_tokens"]


def test_profile_serve_reports_both_paths():
    out = run("profile_serve.py", "--requests", "2", "--prompt-tokens", "64", "--max-new-tokens", "2", "--rows", "3")
    assert "outputs identical True" in out
    assert "--- plain" in out and "--- prefixlab" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_lse_kernels_say_they_need_cuda():
    assert "needs a CUDA device" in run("gpu_lse_kernels.py", code=2)


def test_hit_ttft_resumes_at_the_whole_prefix():
    out = run("gpu_hit_ttft.py", "--device", "cpu", "--prefix", "256", "--suffix", "16", "--rounds", "2")
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["reused_tokens"] == 256 and row["hit_ms"] > 0 and row["floor_ms"] > 0
    assert row["ratio"] == row["hit_ms"] / row["floor_ms"]


def test_lse_kernel_choice_takes_the_fastest_correct_kernel_per_call_kind():
    sys.path.insert(0, str(HERE))
    from gpu_lse_kernels import LSE_TOLERANCE, OUT_TOLERANCE, choose

    ok = {"level_out_error": OUT_TOLERANCE / 2, "level_lse_error": LSE_TOLERANCE / 2,
          "suffix_out_error": OUT_TOLERANCE / 2, "suffix_lse_error": LSE_TOLERANCE / 2}
    rows = [{"kernel": "flex", "level_ms": 0.63, "suffix_ms": 0.61, **ok},
            {"kernel": "cudnn", "level_ms": 0.43, "suffix_ms": 0.70, **ok},
            {"kernel": "matmul", "level_ms": 9.9, "suffix_ms": 0.2, **ok, "suffix_out_error": OUT_TOLERANCE * 2},
            {"kernel": "flash", "error": "RuntimeError: no kernel"},
            {"kernel": "aten_efficient", "level_ms": 0.1, "suffix_ms": 0.1, **ok}]  # not one prefixlab can use
    assert choose(rows) == {"chosen": {"long": "cudnn", "short": "flex"}, "setting": "long=cudnn,short=flex"}
    assert choose([]) == {"chosen": {}, "setting": ""}


def test_padded_batch_primes_every_row_to_the_cached_prompt_and_matches_plain_generate():
    out = run("gpu_padded_batch.py", "--device", "cpu", "--prefix", "96", "--rows", "3", "--question", "4",
              "--new-tokens", "2", "--rounds", "1")
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["tokens_identical"] and row["rows_reused_primed"] == [96, 96, 96]
    assert max(row["rows_reused_unprimed"]) < 96  # one column: no row holds the prompt's end there
    assert row["primed_vs_plain"] == row["plain_ms"] / row["primed_ms"]


def test_sibling_prefill_checks_its_outputs_and_reports_each_round():
    out = run("sibling_prefill.py", "--prefix", "64", "--rows", "3", "--question", "8", "10", "--rounds", "2")
    record = json.loads(out.strip().splitlines()[-1])
    assert record["outputs_identical"] is True and len(record["prefill_ms"]) == 2
    assert record["padding_tokens"] >= 0 and record["median_ms"] in record["prefill_ms"]

