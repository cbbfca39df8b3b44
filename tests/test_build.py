"""Trace builders: structure, timing, determinism, bad input — on tiny local files and on the shared data."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import require_shared
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.errors import InvalidInputError, TraceFormatError
from prefixlab.sim.build import (
    TextEncoder,
    build_conversation_trace,
    build_shared_prefix_trace,
    builtin_trace,
    conversation_requests,
)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A tiny word-level tokenizers JSON (whitespace + punctuation split), so tests need no shared data."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "role content user assistant hello there how are you fine thanks what is up bye".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    punctuation = '{}":,'
    vocab.update({p: len(vocab) + i for i, p in enumerate(punctuation)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    path = tmp_path_factory.mktemp("tok") / "words.json"
    tokenizer.save(str(path))
    return path


def chat(*texts: str) -> dict:
    roles = ("user", "assistant")
    return {"conversation": [{"role": roles[i % 2], "content": text} for i, text in enumerate(texts)]}


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def check_session_structure(requests, encode, conversations):
    """Turn t's input == turn t-1's input + output + the tokens of the json-encoded user message t."""
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    for session_id, turns in by_session.items():
        messages = conversations[int(session_id)]["conversation"]
        assert [r.turn_id for r in turns] == list(range(len(turns)))
        for t, r in enumerate(turns):
            user_ids, reply_ids = encode([json.dumps(messages[2 * t]), json.dumps(messages[2 * t + 1])])
            previous = turns[t - 1].tokens if t else np.zeros(0, dtype=np.int64)
            np.testing.assert_array_equal(r.input_tokens, np.concatenate([previous, user_ids]))
            np.testing.assert_array_equal(r.output_tokens, reply_ids)


def test_conversation_trace_structure_and_timing(tmp_path, word_tokenizer):
    conversations = [
        chat("hello there", "hello", "how are you", "fine thanks", "bye bye bye", "bye"),
        chat("what is up", "fine"),
    ]
    path = write_jsonl(tmp_path / "c.jsonl", conversations)
    requests = build_conversation_trace(path, word_tokenizer, sessions_per_second=0.5)
    encode = TextEncoder(word_tokenizer)
    check_session_structure(requests, encode, conversations)
    assert [(r.session_id, r.turn_id) for r in requests] == [("0", 0), ("0", 1), ("1", 0), ("0", 2)]
    # session 1 starts at 1 / 0.5 s; turns 1 and 2 of session 0 each wait for 2 typed words (spaces) at 90 wpm.
    assert [r.ts for r in requests] == pytest.approx([0.0, 2 * 60 / 90, 2.0, 4 * 60 / 90])
    assert requests[0].input_tokens.dtype == np.int64 and requests[0].input_tokens[0] != 0  # not all [UNK]


def test_conversation_trace_reply_time_context_cap_and_filters(tmp_path, word_tokenizer):
    conversations = [chat("hello", "fine thanks", "how are you", "fine"), chat("bye", "bye")]
    path = write_jsonl(tmp_path / "c.jsonl", conversations)
    slow = build_conversation_trace(path, word_tokenizer, seconds_per_output_token=1.0, min_turns=2)
    assert {r.session_id for r in slow} == {"0"}  # the one-turn chat is filtered out
    reply_tokens = len(slow[0].output_tokens)
    assert slow[1].ts == pytest.approx(reply_tokens * 1.0 + 2 * 60 / 90)
    first_turn_tokens = len(slow[0].tokens)
    capped = build_conversation_trace(path, word_tokenizer, max_context_tokens=first_turn_tokens)
    assert [(r.session_id, r.turn_id) for r in capped] == [("0", 0), ("1", 0)]
    assert len(build_conversation_trace(path, word_tokenizer, max_sessions=1)) == 2


def test_conversation_trace_drops_trailing_unanswered_turn(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "fine", "bye")])
    assert [r.turn_id for r in build_conversation_trace(path, word_tokenizer)] == [0]


def test_conversation_trace_bad_lines_name_file_and_line(tmp_path, word_tokenizer):
    wrong_role = {"conversation": [{"role": "assistant", "content": "x"}]}
    rows = [chat("hello", "fine"), "{not json", wrong_role, chat("a", "b")]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"c\.jsonl:2: "):
        build_conversation_trace(path, word_tokenizer)
    with pytest.warns(UserWarning) as caught:
        requests = build_conversation_trace(path, word_tokenizer, on_error="skip")
    messages = [str(w.message) for w in caught]
    assert any("c.jsonl:2" in m for m in messages) and any("c.jsonl:3" in m and "role" in m for m in messages)
    assert [r.session_id for r in requests] == ["0", "1"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sessions_per_second": 0}, "sessions_per_second"),
        ({"sessions_per_second": "fast"}, "sessions_per_second"),
        ({"words_per_minute": -1}, "words_per_minute"),
        ({"max_context_tokens": 0}, "max_context_tokens"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"seconds_per_output_token": -0.5}, "seconds_per_output_token"),
        ({"sessions_per_second": float("nan")}, "sessions_per_second"),
        ({"min_turns": -1}, "min_turns"),
        ({"max_sessions": True}, "max_sessions"),
    ],
)
def test_conversation_trace_rejects_bad_arguments(tmp_path, word_tokenizer, kwargs, match):
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "fine")])
    with pytest.raises(InvalidInputError, match=match):
        build_conversation_trace(path, word_tokenizer, **kwargs)


def test_conversation_trace_missing_files(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "fine")])
    with pytest.raises(InvalidInputError, match="tokenizer_path"):
        build_conversation_trace(path, tmp_path / "nope.json")
    with pytest.raises(InvalidInputError, match="does not exist"):
        build_conversation_trace(tmp_path / "nope.jsonl", word_tokenizer)


turn_strategy = st.tuples(
    st.lists(st.integers(0, 99), min_size=1, max_size=6),
    st.lists(st.integers(0, 99), max_size=6),
    st.integers(0, 30),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(turn_strategy, max_size=8), st.integers(1, 40), st.floats(0, 10))
def test_conversation_requests_invariants(turns, max_context_tokens, start_s):
    requests = conversation_requests("s", turns, start_s, max_context_tokens=max_context_tokens)
    assert len(requests) <= len(turns)
    history = np.zeros(0, dtype=np.int64)
    for t, r in enumerate(requests):
        user, reply, words = turns[t]
        np.testing.assert_array_equal(r.input_tokens, np.concatenate([history, user]).astype(np.int64))
        np.testing.assert_array_equal(r.output_tokens, np.asarray(reply, dtype=np.int64))
        assert len(r.tokens) <= max_context_tokens
        expected_ts = start_s if t == 0 else requests[t - 1].ts + words * 60 / 90
        assert r.ts == pytest.approx(expected_ts)
        history = r.tokens
    if len(requests) < len(turns):  # it stopped exactly at the first turn that would overflow
        user, reply, _ = turns[len(requests)]
        assert len(history) + len(user) + len(reply) > max_context_tokens


def test_lmsys_trace_on_shared_data():
    conversations_path = require_shared("traces/lmsys_chat_1000.jsonl")
    tokenizer_path = require_shared("tokenizers/gpt-neox-20b.json")
    requests = build_conversation_trace(conversations_path, tokenizer_path, sessions_per_second=1.0)
    # deterministic, and the first 40 sessions come out the same when built alone
    again = build_conversation_trace(conversations_path, tokenizer_path, sessions_per_second=1.0, max_sessions=40)
    assert all(
        a.session_id == b.session_id and a.ts == b.ts and np.array_equal(a.tokens, b.tokens)
        for a, b in zip([r for r in requests if int(r.session_id) < 40], again, strict=True)
    )
    assert [r.ts for r in requests] == sorted(r.ts for r in requests)
    assert len({r.session_id for r in requests}) == 191 and len(requests) == 1001  # every turn fits in 32k
    conversations = [json.loads(line) for line in open(conversations_path)]
    check_session_structure(requests[:200], TextEncoder(tokenizer_path), conversations)


def quality_row(article_lines, questions):
    row = {"article": article_lines}
    for i, (question, options, gold) in enumerate(questions, start=1):
        row[f"question{i}"] = question
        row.update({f"question{i}option{k}": option for k, option in enumerate(options, start=1)})
        row[f"question{i}_gold_label"] = gold
    return row


def test_document_qa_trace(tmp_path, word_tokenizer):
    rows = [
        quality_row(["<p>hello there</p>\n", " <b>how</b> are you"], [("what is up", ["fine", "bye"], 2)]),
        quality_row(["thanks"], [("how are you", ["fine", "bye"], 1), ("what", ["up", "fine"], 1)]),
    ]
    path = write_jsonl(tmp_path / "quality.jsonl", rows)
    requests = build_shared_prefix_trace(path, word_tokenizer, num_requests=60, requests_per_second=2.0, seed=3)
    encode = TextEncoder(word_tokenizer)
    documents = [np.asarray(ids) for ids in encode(["hello there how are you", "thanks"])]
    answers = {tuple(ids) for ids in encode([" bye", " fine", " up"])}
    assert len(requests) == 60 and {r.turn_id for r in requests} == {0}
    for r in requests:
        document = documents[int(r.session_id.split("-")[0][1:])]
        np.testing.assert_array_equal(r.input_tokens[: len(document)], document)  # html tags are stripped
        assert len(r.input_tokens) > len(document) and tuple(r.output_tokens.tolist()) in answers
    assert {len(r.input_tokens) for r in requests if r.session_id.startswith("p1")} == {
        len(documents[1]) + len(q)
        for q in encode(
            ["\n\nQuestion: how are you\n1. fine\n2. bye\nAnswer:", "\n\nQuestion: what\n1. up\n2. fine\nAnswer:"]
        )
    }
    gaps = np.diff([r.ts for r in requests])
    assert requests[0].ts == 0.0 and (gaps >= 0).all() and 0.25 < gaps.mean() < 0.8  # Poisson at 2/s


def test_system_prompt_trace_popularity_determinism_and_queries(tmp_path, word_tokenizer):
    prompts = [{"path": f"p{i}.md", "text": " ".join(["hello there how are you"] * (i + 1))} for i in range(6)]
    path = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    kwargs = dict(num_requests=400, query_tokens=(3, 5), output_tokens=(2, 2), seed=7)
    requests = build_shared_prefix_trace(path, word_tokenizer, **kwargs)
    again = build_shared_prefix_trace(path, word_tokenizer, **kwargs)
    assert all(np.array_equal(a.tokens, b.tokens) and a.ts == b.ts for a, b in zip(requests, again, strict=True))
    counts = sorted(Counter(r.session_id.split("-")[0] for r in requests).values(), reverse=True)
    assert counts[0] > 2.5 * counts[-1]  # Zipf(1): the most popular prompt is asked far more than the least
    uniform = build_shared_prefix_trace(path, word_tokenizer, **{**kwargs, "popularity_skew": 0.0})
    assert max(Counter(r.session_id.split("-")[0] for r in uniform).values()) < 2 * 400 / 6
    prompt_lengths = [len(ids) for ids in TextEncoder(word_tokenizer)([p["text"] for p in prompts])]
    for r in requests:
        assert len(r.input_tokens) - prompt_lengths[int(r.session_id.split("-")[0][1:])] in (3, 4, 5)
        assert len(r.output_tokens) == 2


def test_system_prompt_trace_path_prefix_selects_one_family(tmp_path, word_tokenizer):
    prompts = [
        {"path": "a/v1.md", "text": "hello there"},
        {"path": "b/x.md", "text": "bye"},
        {"path": "a/v2.md", "text": "hello you"},
    ]
    path = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    requests = build_shared_prefix_trace(path, word_tokenizer, num_requests=50, path_prefix="a/")
    first_tokens = {int(r.input_tokens[0]) for r in requests}
    assert first_tokens == set(TextEncoder(word_tokenizer)(["hello"])[0])  # never the "bye" prompt
    assert {r.session_id.split("-")[0] for r in requests} == {"p0", "p1"}
    with pytest.raises(InvalidInputError, match="path_prefix 'c/' matches no prompt"):
        build_shared_prefix_trace(path, word_tokenizer, path_prefix="c/")
    documents = write_jsonl(tmp_path / "q.jsonl", [quality_row(["text"], [("q", ["a"], 1)])])
    with pytest.raises(InvalidInputError, match="path_prefix selects system prompts"):
        build_shared_prefix_trace(documents, word_tokenizer, path_prefix="a/")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"requests_per_second": -1.0}, "requests_per_second"),
        ({"popularity_skew": -0.5}, "popularity_skew"),
        ({"query_tokens": (5, 2)}, "query_tokens"),
        ({"output_tokens": 7}, "output_tokens"),
        ({"seed": -1}, "seed"),
    ],
)
def test_shared_prefix_trace_rejects_bad_arguments(tmp_path, word_tokenizer, kwargs, match):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "hello"}])
    with pytest.raises(InvalidInputError, match=match):
        build_shared_prefix_trace(path, word_tokenizer, **kwargs)


def test_shared_prefix_trace_bad_files(tmp_path, word_tokenizer):
    with pytest.raises(TraceFormatError, match=r"other\.jsonl: the first line is neither"):
        build_shared_prefix_trace(write_jsonl(tmp_path / "other.jsonl", [{"prompt": "x"}]), word_tokenizer)
    bad_gold = quality_row(["text"], [("q", ["a", "b"], 3)])
    path = write_jsonl(tmp_path / "q.jsonl", [quality_row(["text"], [("q", ["a"], 1)]), bad_gold])
    with pytest.raises(TraceFormatError, match=r"q\.jsonl:2: question1_gold_label must be an option number"):
        build_shared_prefix_trace(path, word_tokenizer)
    with pytest.warns(UserWarning, match=r"q\.jsonl:2"):
        assert len(build_shared_prefix_trace(path, word_tokenizer, num_requests=5, on_error="skip")) == 5
    empty_prompt = write_jsonl(tmp_path / "p.jsonl", [{"text": ""}])
    with pytest.warns(UserWarning), pytest.raises(TraceFormatError, match="no usable line"):
        build_shared_prefix_trace(empty_prompt, word_tokenizer, on_error="skip")


def test_shared_prefix_traces_on_shared_data():
    tokenizer_path = require_shared("tokenizers/gpt-neox-20b.json")
    prompts_path = require_shared("system_prompts/system_prompts.jsonl")
    # One product's successive prompt versions (30 prompts): some pairs share thousands of tokens.
    prompts = build_shared_prefix_trace(
        prompts_path, tokenizer_path, num_requests=300, path_prefix="Anthropic/official"
    )
    first = {r.session_id.split("-")[0]: r.input_tokens for r in prompts}
    assert len(prompts) == 300 and len(first) > 15

    def shared(a, b):
        n = min(len(a), len(b))
        return int(np.argmin(np.append(a[:n] == b[:n], False)))

    depths = [shared(a, b) for i, a in enumerate(first.values()) for b in list(first.values())[i + 1 :]]
    assert max(depths) > 1500 and sorted(depths)[len(depths) // 2] < 100  # deep for some versions, shallow for most
    documents = build_shared_prefix_trace(require_shared("traces/quality_example.jsonl"), tokenizer_path)
    assert {r.session_id.split("-")[0] for r in documents} == {"p0", "p1"}
    assert min(len(r.input_tokens) for r in documents) > 3000  # long documents are the shared prefix


def test_builtin_trace_is_deterministic_and_mixed():
    trace = builtin_trace()
    assert all(np.array_equal(a.tokens, b.tokens) and a.ts == b.ts for a, b in zip(trace, builtin_trace(), strict=True))
    assert [r.ts for r in trace] == sorted(r.ts for r in trace)
    chats = [r for r in trace if r.session_id.startswith("chat-")]
    assert len({r.session_id for r in chats}) == 24 and max(r.turn_id for r in chats) >= 3
    assert len(trace) - len(chats) == 48
    previous = {}
    for r in chats:  # multi-turn structure: each turn resumes from the previous turn's input + output
        if r.session_id in previous:
            np.testing.assert_array_equal(r.input_tokens[: len(previous[r.session_id])], previous[r.session_id])
        previous[r.session_id] = r.tokens
    # the prompt versions diverge at depth 1200 (p0, p1) and 600 (p0, p2); p3 is unrelated
    by_prompt = {r.session_id.split("-")[0]: r.input_tokens for r in trace if not r.session_id.startswith("chat-")}
    assert set(by_prompt) == {"p0", "p1", "p2", "p3"}

    def shared_length(a, b):
        n = min(len(a), len(b))
        return int(np.argmin(np.append(a[:n] == b[:n], False)))

    assert shared_length(by_prompt["p0"], by_prompt["p1"]) == 1200
    assert shared_length(by_prompt["p0"], by_prompt["p2"]) == 600
    assert shared_length(by_prompt["p1"], by_prompt["p2"]) == 600
    assert shared_length(by_prompt["p0"], by_prompt["p3"]) < 3
    assert not np.array_equal(builtin_trace(seed=1)[0].input_tokens, trace[0].input_tokens)
    with pytest.raises(InvalidInputError, match="num_sessions"):
        builtin_trace(num_sessions=-1)


@pytest.mark.parametrize("kwargs, match", [({"sessions_per_second": 1e-310}, "sessions_per_second=1e-310"),
                                           ({"words_per_minute": 1e-310}, "words_per_minute=1e-310")])
def test_conversation_rates_too_small_for_a_float_time_are_refused(tmp_path, word_tokenizer, kwargs, match):
    """(Arrival times overflowed to inf, and writing the trace failed naming requests[6].ts, not the rate.)"""
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "fine", "how are you", "fine")] * 2)
    with pytest.raises(InvalidInputError, match=f"{match}.*larger"):
        build_conversation_trace(path, word_tokenizer, **kwargs)


def test_a_request_rate_too_small_for_a_float_time_is_refused(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "hello"}])
    with pytest.raises(InvalidInputError, match="requests_per_second=1e-310.*larger"):
        build_shared_prefix_trace(path, word_tokenizer, num_requests=3, requests_per_second=1e-310)

