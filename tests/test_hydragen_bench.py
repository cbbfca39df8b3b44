"""`prefixlab bench hydragen` at tiny sizes: the fields it reports and its errors (real runs: benchmarks/)."""

import json

from prefixlab.bench.hydragen_e2e import bench_e2e
from prefixlab.cli import main


def test_cli_json_has_the_timings_and_speedup(capsys):
    code = main(["bench", "hydragen", "--batch", "3", "--prefix", "32", "--suffix", "4", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--no-packed", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"sdpa_ms", "split_ms", "packed_ms", "speedup"} <= result.keys()
    assert result["speedup"] == result["sdpa_ms"] / result["split_ms"] and result["packed_ms"] is None


def test_cli_rejects_bad_sizes(capsys):
    assert main(["bench", "hydragen", "--batch", "0", "--no-packed"]) == 2
    assert "--batch=0 must be at least 1" in capsys.readouterr().err


def test_e2e_runs_all_three_and_hydragen_matches_standard():
    result = bench_e2e("llama", completions=2, prompt_tokens=12, new_tokens=2)
    assert result["same_tokens"]
    assert all(result[f"{run}_tok_s"] > 0 for run in ("standard", "hydragen", "no_attention"))
