"""`prefixlab trace build`, end to end through prefixlab.cli.main."""

import json
import os

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, only_sim_subcommands, run  # noqa: F401 (an autouse fixture)

from prefixlab.sim.build import build_conversation_trace, build_shared_prefix_trace, builtin_trace
from prefixlab.sim.formats import read_trace


def same_trace(a, b):
    return len(a) == len(b) and all(
        x.session_id == y.session_id and x.ts == y.ts and np.array_equal(x.tokens, y.tokens)
        for x, y in zip(a, b, strict=True)
    )


def test_trace_build_builtin(capsys, tmp_path):
    out = tmp_path / "builtin.jsonl"
    code, _, err = run(capsys, "trace", "build", "builtin", "-o", out)
    assert code == 0 and f"wrote {len(builtin_trace())} requests" in err
    assert same_trace(read_trace(out), builtin_trace())


def test_trace_build_conversations_and_shared_prefix(capsys, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "bye": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    chats = tmp_path / "chats.jsonl"
    chat = {"conversation": [{"role": "user", "content": "hello bye"}, {"role": "assistant", "content": "bye"}] * 2}
    chats.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    tok = tmp_path / "tok.json"
    conversations = ("trace", "build", "conversations", "--input", chats, "--tokenizer", tok)
    out = tmp_path / "conv.jsonl"
    code, _, _ = run(capsys, *conversations, "--rate", "0.5", "--max-sessions", "1", "-o", out)
    assert code == 0
    expected = build_conversation_trace(chats, tok, sessions_per_second=0.5, max_sessions=1)
    assert same_trace(read_trace(out), expected) and len(expected) == 2

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": "hello " * n}) + "\n" for n in (3, 5, 8)))
    shared = ("trace", "build", "shared-prefix", "--input", prompts, "--tokenizer", tok)
    out = tmp_path / "shared.jsonl"
    code, _, _ = run(capsys, *shared, "--num-requests", "20", "--rate", "4", "--skew", "0", "--seed", "5", "-o", out)
    assert code == 0
    expected = build_shared_prefix_trace(
        prompts, tok, num_requests=20, requests_per_second=4.0, popularity_skew=0.0, seed=5
    )
    assert same_trace(read_trace(out), expected)

    assert_one_line_error(capsys, *conversations, "--rate", "fast", "-o", out, match="--rate 'fast' is not a number")
    # sessions 1 / 1e-310 s apart: the second arrives at inf, which a JSON trace cannot hold
    assert_one_line_error(capsys, *conversations, "--rate", "1e-310", "-o", out,
                          match="sessions_per_second=1e-310, words_per_minute=90")
    assert_one_line_error(capsys, *shared, "--num-requests", "2.5", "-o", out, match="not an integer")
    missing = ("trace", "build", "conversations", "--input", tmp_path / "none.jsonl", "--tokenizer", tok)
    assert_one_line_error(capsys, *missing, "-o", out, match="does not exist")
    assert_one_line_error(
        capsys, "trace", "build", "builtin", "-o", tmp_path / "no" / "t.jsonl", match="does not exist"
    )


def test_trace_build_agentic_few_shot_and_mix(capsys, tmp_path):
    from prefixlab.sim.workloads import agentic_trace, few_shot_trace, mix_traces

    agent, shots, mixed = tmp_path / "agent.jsonl", tmp_path / "shots.jsonl", tmp_path / "mix.jsonl"
    assert run(capsys, "trace", "build", "agentic", "--sessions", "2", "--seed", "4", "-o", agent)[0] == 0
    assert same_trace(read_trace(agent), agentic_trace(4, 2))
    assert run(capsys, "trace", "build", "few-shot", "--num-requests", "9", "-o", shots)[0] == 0
    assert same_trace(read_trace(shots), few_shot_trace(0, 9))
    assert run(capsys, "trace", "build", "mix", agent, shots, "-o", mixed)[0] == 0
    assert same_trace(read_trace(mixed), mix_traces([read_trace(agent), read_trace(shots)], ["agent", "shots"]))
    assert run(capsys, "trace", "build", "mix", shots, shots, "-o", mixed)[0] == 0  # one file twice: two names
    assert {r.session_id.split("/")[0] for r in read_trace(mixed)} == {"shots", "shots#2"}
    assert_one_line_error(capsys, "trace", "build", "few-shot", "--num-requests", "0", "-o", mixed, match="0")
    assert_one_line_error(capsys, "trace", "build", "agentic", "--sessions", "0", "-o", agent, match="> 0")
    assert_one_line_error(capsys, "trace", "build", "agentic", "-o", tmp_path, match="is a folder")
    before = agent.read_bytes()
    assert_one_line_error(capsys, "trace", "build", "mix", agent, shots, "-o", agent, match="one of the build's inputs")
    assert agent.read_bytes() == before


def test_trace_build_mix_names_never_collide(capsys, tmp_path):
    # a file whose stem is another's second name (shots#2) and the same stem twice: every trace still gets its own
    (tmp_path / "b").mkdir()
    shots, shots2, other, mixed = (tmp_path / "shots.jsonl", tmp_path / "shots#2.jsonl", tmp_path / "b" / "shots.jsonl",
                                   tmp_path / "mix.jsonl")
    for path, seed in ((shots, "0"), (shots2, "1"), (other, "2")):
        assert run(capsys, "trace", "build", "few-shot", "--num-requests", "3", "--seed", seed, "-o", path)[0] == 0
    assert run(capsys, "trace", "build", "mix", shots, shots2, other, "-o", mixed)[0] == 0
    names = {r.session_id.split("/")[0] for r in read_trace(mixed)}
    assert len(names) == 3 and {"shots", "shots#2"} <= names


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc, where no file can be created")
def test_trace_build_to_a_place_that_cannot_be_written(capsys):
    assert_one_line_error(capsys, "trace", "build", "builtin", "-o", "/proc/trace.jsonl", match="cannot write")


def test_trace_build_mix_of_nothing_writes_no_file(capsys, tmp_path):
    bad, out = tmp_path / "bad.jsonl", tmp_path / "mix.jsonl"
    bad.write_text('{"session_id": "x", "turn_id": 0, "ts": NaN, "input_tokens": [1]}\n')
    with pytest.warns(UserWarning, match="bad.jsonl:1"):
        assert_one_line_error(capsys, "trace", "build", "mix", bad, "--on-error", "skip", "-o", out,
                              match="no request")
    assert not out.exists()


def test_trace_build_refuses_to_overwrite_a_default_shared_input(capsys, tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "tokenizers").mkdir(parents=True)
    (data / "traces").mkdir()
    (data / "system_prompts").mkdir()
    (data / "system_prompts" / "system_prompts.jsonl").write_text("{}\n")
    tokenizer, chats = data / "tokenizers" / "gpt-neox-20b.json", data / "traces" / "lmsys_chat_1000.jsonl"
    tokenizer.write_text("{}")
    chats.write_text("{}\n")
    monkeypatch.setenv("PREFIXLAB_SHARED_DATA", str(data))
    for kind, target in (("conversations", chats), ("shared-prefix", tokenizer), ("conversations", tokenizer)):
        before = target.read_bytes()
        assert_one_line_error(capsys, "trace", "build", kind, "-o", target, match="one of the build's inputs")
        assert target.read_bytes() == before
