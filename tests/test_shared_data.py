"""Where the shared benchmark data is looked for, and what a test or benchmark says when it is not there."""

import os
import subprocess
import sys
from pathlib import Path

from prefixlab.data import absent, shared_file

REPO = Path(__file__).resolve().parents[1]


def test_absent_names_the_missing_file_and_the_variable(tmp_path, monkeypatch):
    (tmp_path / "tokenizers").mkdir()
    (tmp_path / "tokenizers" / "t.json").write_text("{}")
    monkeypatch.setenv("PREFIXLAB_SHARED_DATA", str(tmp_path))
    assert absent("tokenizers/t.json") is None and shared_file("tokenizers/t.json") == tmp_path / "tokenizers/t.json"
    reason = absent("tokenizers/t.json", "traces/x.jsonl")
    assert str(tmp_path / "traces/x.jsonl") in reason and "PREFIXLAB_SHARED_DATA" in reason


def test_absent_says_when_the_variable_is_not_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXLAB_SHARED_DATA", str(tmp_path / "typo"))
    monkeypatch.chdir(tmp_path)
    reason = absent("traces/never-there.jsonl")
    assert f"PREFIXLAB_SHARED_DATA={tmp_path / 'typo'} is not a folder" in reason


def test_benchmarks_skip_without_the_data_saying_how_to_point_at_it(tmp_path):
    """`make bench` on a clone without ../shared/data: every benchmark that needs it says to set the variable."""
    env = {**os.environ, "PREFIXLAB_SHARED_DATA": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/test_bench_traces.py", "benchmarks/test_bench_sim.py",
         "--benchmark-enable", "-p", "no:cacheprovider", "-rs", "-k", "build_ or faithfulness or versions_table"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert done.returncode == 0 and len(skips) == 4, done.stdout[-3000:]
    assert all("set PREFIXLAB_SHARED_DATA" in line for line in skips), "\n".join(skips)
