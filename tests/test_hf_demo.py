"""`prefixlab demo` end to end on a shortened workload (short system prompts keep it quick)."""

import pytest
from conftest import require_shared

import prefixlab.demo as demo
from prefixlab.cli import main


@pytest.fixture
def short_prompts(monkeypatch):
    monkeypatch.setattr(demo, "SYSTEM_PROMPT_TOKENS", 96)


@pytest.mark.parametrize("data", ["shared", "builtin"])
def test_demo_serves_identically_and_reports(data, short_prompts, monkeypatch, tmp_path, capsys):
    if data == "builtin":
        monkeypatch.setattr(demo, "shared_file", lambda relative: None)
    else:
        require_shared("tokenizers/gpt-neox-20b.json")
    assert main(["demo", "--requests", "6", "--max-new-tokens", "2", "--plot", str(tmp_path / "demo.png")]) == 0
    out = capsys.readouterr().out
    assert "generated tokens identical with and without prefixlab: yes" in out
    assert "TTFT without prefixlab: P50" in out and "TTFT with prefixlab:    P50" in out
    assert ("byte tokenizer" in out) == (data == "builtin")
    hits = [int(line.split("hit")[1].split()[0]) for line in out.splitlines() if " hit " in line]
    assert len(hits) == 6 and hits[0] == 0 and max(hits) >= 96  # later requests reuse a system prompt
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_summary_flags_differing_tokens():
    request = demo.Request("chat", 0, [5, 6])
    served = [demo.Served(request, 10, 0, 0.2, 0.1, True, 0.2, 0.1),
              demo.Served(request, 12, 9, 0.2, 0.05, False, 0.2, 0.04)]
    text, identical = demo.summarize(served)
    assert not identical and "NO" in text and "speedup" in text


def test_requests_must_be_positive():
    with pytest.raises(SystemExit):
        main(["demo", "--requests", "0"])
