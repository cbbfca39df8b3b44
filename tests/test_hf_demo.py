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
    lines = [line for line in out.splitlines() if " prompt " in line and " hit " in line]
    hits = [int(line.split(" hit ")[1].split()[0]) for line in lines]
    assert len(hits) == 6 and hits[0] == 0 and max(hits) >= 96  # later requests reuse a system prompt
    assert [line.split()[-1] for line in lines][0] == "cold" and "why each request reused what it did: " in out
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_every_request_states_the_reason_the_workload_gives_it(short_prompts, monkeypatch):
    """The reasons of the demo workload, checked against the workload itself: what a request shares with earlier
    ones is the longest common prefix of its prompt (but the last token) with their prompt + output[:-1]; with no
    evictions, one namespace and batch 1, the reason must be cold (nothing shared), hit (all of it reused) or
    no_checkpoint (less reused than shared)."""
    import torch
    from tqdm import tqdm

    from prefixlab import PrefixStore

    monkeypatch.setattr(demo, "shared_file", lambda relative: None)
    encode, vocab_size, _ = demo._encoder()
    system, requests = demo.build_workload(9, encode)
    model = demo.build_model(vocab_size)
    store = PrefixStore(model, capacity="1GB", policy="dp")
    with torch.inference_mode(), tqdm(total=len(requests), disable=True) as progress:
        served = demo.serve(model, store, system, requests, 2, progress)
    assert store.stats()["evictions"] == 0
    admitted: list[tuple[int, ...]] = []
    for s in served:
        probe = s.sequence[: s.prompt_tokens - 1]
        shared = max((_common_prefix(probe, earlier) for earlier in admitted), default=0)
        assert s.shared_tokens == shared
        expected = "cold" if not shared else "hit" if s.hit_tokens == shared else "no_checkpoint"
        assert s.reason == expected, (s.hit_tokens, shared, s.reason)
        admitted.append(s.sequence[:-1])
    assert {"cold", "hit", "no_checkpoint"} <= {s.reason for s in served}
    store.close()


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_summary_flags_differing_tokens():
    request = demo.Request("chat", 0, [5, 6])
    served = [demo.Served(request, 10, 0, 0.2, 0.1, True, 0.2, 0.1),
              demo.Served(request, 12, 9, 0.2, 0.05, False, 0.2, 0.04)]
    text, identical = demo.summarize(served)
    assert not identical and "NO" in text and "speedup" in text


def test_requests_must_be_positive():
    with pytest.raises(SystemExit):
        main(["demo", "--requests", "0"])


def test_demo_checks_the_plot_path_before_serving(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "build_model", lambda vocab_size: pytest.fail("the model was built"))
    for path, message in ((tmp_path / "demo.txt", ".png, .pdf or .svg"), (tmp_path / "no" / "d.png", "does not exist")):
        assert main(["demo", "--requests", "2", "--plot", str(path)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="needs Linux's /proc, where no file is created")
def test_a_plot_that_cannot_be_written_is_a_one_line_error(tmp_path):
    """--plot passed check_plot_path (a .png in an existing folder), then the demo and the Hydragen sweep ended in
    matplotlib's OSError traceback after the whole run, where simulate's plots say they cannot write."""
    from prefixlab.bench.hydragen import plot_sweep
    from prefixlab.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="cannot write"):
        demo.plot([], "/proc/demo.png")
    with pytest.raises(InvalidInputError, match="cannot write"):
        plot_sweep([], "/proc/sweep.png")
