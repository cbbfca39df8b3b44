"""Trace formats: auto-detection, Marconi round trip, Mooncake block semantics, malformed lines."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.errors import InvalidInputError, TraceFormatError
from prefixlab.sim.formats import MOONCAKE_BLOCK_TOKENS, detect_format, read_trace, write_trace
from prefixlab.sim.trace import Request


def write_lines(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def marconi_row(session_id=0, turn_id=0, ts=0.0, inputs=(1, 2, 3), outputs=(4,)):
    return {
        "session_id": session_id,
        "turn_id": turn_id,
        "ts": ts,
        "input_tokens": list(inputs),
        "output_tokens": list(outputs),
    }


def mooncake_row(timestamp_ms, input_length, hash_ids, output_length=3):
    return {
        "timestamp": timestamp_ms,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def same_requests(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(
        x.session_id == y.session_id
        and x.turn_id == y.turn_id
        and x.ts == y.ts
        and np.array_equal(x.input_tokens, y.input_tokens)
        and np.array_equal(x.output_tokens, y.output_tokens)
        for x, y in zip(a, b, strict=True)
    )


request_strategy = st.builds(
    Request,
    session_id=st.text(min_size=1, max_size=8),
    turn_id=st.integers(0, 50),
    ts=st.floats(0, 1e6, allow_nan=False),
    input_tokens=st.lists(st.integers(0, 2**40), max_size=20).map(lambda v: np.asarray(v, dtype=np.int64)),
    output_tokens=st.lists(st.integers(0, 2**40), max_size=20).map(lambda v: np.asarray(v, dtype=np.int64)),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(request_strategy, max_size=6))
def test_marconi_round_trip(tmp_path_factory, requests):
    requests = sorted(requests, key=lambda r: r.ts)
    path = tmp_path_factory.mktemp("rt") / "trace.jsonl"
    write_trace(path, requests)
    if requests:
        assert detect_format(path) == "marconi"
        loaded = read_trace(path)
        assert same_requests(loaded, requests)
        assert all(r.input_tokens.dtype == np.int64 and r.output_tokens.dtype == np.int64 for r in loaded)


def test_marconi_reader_accepts_reference_layout_and_sorts_by_ts(tmp_path):
    rows = [
        {**marconi_row(7, 1, 2.5, inputs=[5, 6]), "num_input_tokens": 2, "num_output_tokens": 1},
        {k: v for k, v in marconi_row(3, 0, 1.0).items() if k != "output_tokens"},  # an absent output is empty
    ]
    requests = read_trace(write_lines(tmp_path / "t.jsonl", rows))
    assert [(r.session_id, r.turn_id, r.ts) for r in requests] == [("3", 0, 1.0), ("7", 1, 2.5)]
    assert requests[0].output_tokens.size == 0 and requests[1].input_tokens.tolist() == [5, 6]


def test_mooncake_block_semantics(tmp_path):
    rows = [
        mooncake_row(1500, 1100, [10, 11, 12]),  # 3 blocks, the last one 76 tokens long
        mooncake_row(0, 900, [10, 13]),  # shares block 10 only
        mooncake_row(3000, 1024, [10, 11]),  # exactly two full blocks, same as the first request's first two
    ]
    path = write_lines(tmp_path / "mc.jsonl", rows)
    assert detect_format(path) == "mooncake"
    second, first, third = read_trace(path)  # sorted by arrival: timestamps are milliseconds
    assert [r.ts for r in (second, first, third)] == [0.0, 1.5, 3.0]
    assert [len(r.input_tokens) for r in (first, second, third)] == [1100, 900, 1024]
    block = MOONCAKE_BLOCK_TOKENS
    np.testing.assert_array_equal(first.input_tokens[:block], second.input_tokens[:block])
    np.testing.assert_array_equal(first.input_tokens[: 2 * block], third.input_tokens)
    # different hash ids give different blocks from their very first token (no spurious shared prefix)
    assert first.input_tokens[block] != second.input_tokens[block]
    # outputs are synthetic, per request, and never repeat an input block
    assert [len(r.output_tokens) for r in (first, second, third)] == [3, 3, 3]
    assert not np.array_equal(first.output_tokens, third.output_tokens)
    assert not np.isin(first.output_tokens, first.input_tokens).any()
    assert same_requests(read_trace(path), [second, first, third])  # deterministic


def test_mooncake_partial_last_block_is_prefix_of_full_block(tmp_path):
    path = write_lines(tmp_path / "mc.jsonl", [mooncake_row(0, 700, [4, 5]), mooncake_row(1, 1024, [4, 5])])
    partial, full = read_trace(path)
    np.testing.assert_array_equal(partial.input_tokens, full.input_tokens[:700])


@pytest.mark.parametrize(
    "bad_row, reason",
    [
        ("{truncated", "Expecting|Unterminated|delimiter"),
        ("[1, 2]", "expected a JSON object"),
        ({k: v for k, v in marconi_row().items() if k != "ts"}, "missing field 'ts'"),
        (marconi_row(inputs=[1, "x", 3]), "input_tokens must be a flat list of integer token ids, found 'x'"),
        (marconi_row(inputs=[1, 2.5]), "input_tokens must be a flat list of integer token ids, found 2.5"),
        (marconi_row(outputs=[[1], [2]]), "output_tokens must be a flat list"),
        (marconi_row(inputs=[1, -4]), "out of range"),
        (marconi_row(inputs=[1, 2**70]), "out of range"),  # numpy holds it as an object, not a non-int
        (marconi_row(inputs=[1, None]), "input_tokens must be a flat list of integer token ids, found None"),
        (marconi_row(inputs=[True, 2]), "input_tokens holds a boolean"),  # (numpy read it as [1, 2])
        ("[" * 100_000, "recursion"),  # nested too deep for json: a bad line, not a RecursionError
        ({**marconi_row(), "input_tokens": "1 2 3"}, "input_tokens must be a list of token ids"),
        (marconi_row(turn_id=-1), "turn_id must be a non-negative integer"),
        (marconi_row(ts="soon"), "ts must be a number"),
        ({**marconi_row(), "ts": float("nan")}, "ts must be finite"),
        ({**marconi_row(), "ts": 10**400}, "ts must be finite"),  # an int beyond float: OverflowError
        (marconi_row(session_id=None), "session_id must be a string or integer"),
    ],
)
def test_marconi_malformed_line_names_file_and_line(tmp_path, bad_row, reason):
    path = write_lines(tmp_path / "bad.jsonl", [marconi_row(ts=0.0), "", bad_row, marconi_row(1, ts=1.0)])
    with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:3: .*({reason})"):
        read_trace(path)
    with pytest.warns(UserWarning, match=r"bad\.jsonl:3"):
        kept = read_trace(path, on_error="skip")
    assert [r.session_id for r in kept] == ["0", "1"]


@pytest.mark.parametrize(
    "bad_row, reason",
    [
        (mooncake_row(0, 1100, [1, 2]), r"hash_ids has 2 ids but input_length 1100 needs ceil\(1100/512\) = 3"),
        (mooncake_row(0, 10, [True]), "hash_ids must be integers"),
        (mooncake_row(0, 10, [-1]), "hash_ids must be integers"),
        ({**mooncake_row(0, 10, [1]), "output_length": 1.5}, "output_length must be a non-negative integer"),
        ({**mooncake_row(0, 10, [1]), "output_length": 10**13}, r"output_length must be at most 2\*\*24"),
        # (the reader built 30 GiB of synthetic ids for it)
        ({**mooncake_row(0, 10, [1]), "output_length": 4 * 10**9}, r"output_length must be at most 2\*\*24"),
        ({**mooncake_row(0, 10, [1]), "timestamp": -10**400}, "timestamp must be finite"),
        ({k: v for k, v in mooncake_row(0, 10, [1]).items() if k != "timestamp"}, "missing field 'timestamp'"),
    ],
)
def test_mooncake_malformed_line(tmp_path, bad_row, reason):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake_row(0, 10, [1]), bad_row, mooncake_row(5, 10, [1])])
    with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:2: {reason}"):
        read_trace(path)
    with pytest.warns(UserWarning, match=r"bad\.jsonl:2"):
        first, third = read_trace(path, on_error="skip")
    # a skipped line keeps its index: the third line's session and outputs do not depend on the second's fate
    assert third.session_id == "mooncake-2"
    good = write_lines(
        tmp_path / "good.jsonl", [mooncake_row(0, 10, [1]), mooncake_row(3, 10, [1]), mooncake_row(5, 10, [1])]
    )
    np.testing.assert_array_equal(read_trace(good)[2].output_tokens, third.output_tokens)


def test_invalid_utf8_line_is_a_format_error(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(marconi_row()).encode() + b"\n\xff\xfe{\n")
    with pytest.raises(TraceFormatError, match=r"bytes\.jsonl:2: "):
        read_trace(path)
    with pytest.warns(UserWarning, match=r"bytes\.jsonl:2"):
        assert len(read_trace(path, on_error="skip")) == 1


def test_unrecognised_or_missing_files(tmp_path):
    path = write_lines(tmp_path / "other.jsonl", ["not json", {"prompt": "hi"}])
    with pytest.raises(TraceFormatError, match="other.jsonl: no line looks like a trace record"):
        read_trace(path)
    with pytest.raises(InvalidInputError, match="does not exist"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(InvalidInputError, match="on_error"):
        read_trace(path, on_error="ignore")


def test_write_trace_converts_everything_before_writing(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("previous contents\n")
    with pytest.raises(InvalidInputError, match=r"requests\[1\] is a str"):
        write_trace(path, [Request("a", 0, 0.0, np.arange(3)), "not a request"])
    with pytest.raises(InvalidInputError, match=r"requests\[0\]\.output_tokens must be a 1-D integer array"):
        write_trace(path, [Request("a", 0, 0.0, np.arange(3), np.array([0.5]))])
    with pytest.raises(InvalidInputError, match=r"requests\[1\]\.ts=inf is not a finite"):  # JSON has no Infinity
        write_trace(path, [Request("a", 0, 0.0, np.arange(3)), Request("a", 1, float("inf"), np.arange(3))])
    # what read_trace would refuse is not written either
    for bad, match in ((Request("a", 0, 0.0, np.array([1, -2])), "out of range"),
                       (Request("a", 0, 0.0, np.array([2**63], dtype=np.uint64)), "out of range"),
                       (Request("a", -1, 0.0, np.arange(3)), "turn_id must be a non-negative"),
                       (Request(None, 0, 0.0, np.arange(3)), "session_id"),
                       (Request("a", 1.5, 0.0, np.arange(3)), r"turn_id=1\.5 must be an int")):
        with pytest.raises(InvalidInputError, match=match):
            write_trace(path, [Request("b", 0, 0.0, np.arange(2)), bad])
    assert path.read_text() == "previous contents\n"


def test_booleans_in_other_list_fields_are_not_token_ids(tmp_path):
    row = {**marconi_row(), "flags": [True, False]}
    mooncake = {**mooncake_row(0, 10, [1]), "cached": [False]}
    assert len(read_trace(write_lines(tmp_path / "m.jsonl", [row]))) == 1
    assert len(read_trace(write_lines(tmp_path / "mc.jsonl", [mooncake]))) == 1
    with pytest.raises(TraceFormatError, match="hash_ids"):  # (in the ids still refused)
        read_trace(write_lines(tmp_path / "bad.jsonl", [{**mooncake, "hash_ids": [True]}]))


def test_mooncake_files_read_with_other_salts_share_nothing(tmp_path):
    path = write_lines(tmp_path / "mc.jsonl", [mooncake_row(0, 1100, [10, 11, 12]), mooncake_row(1, 900, [10, 13])])
    plain, again, salted = read_trace(path), read_trace(path, salt=0), read_trace(path, salt=1)
    assert same_requests(plain, again)
    assert [len(r.input_tokens) for r in salted] == [len(r.input_tokens) for r in plain]
    assert all(not np.isin(s.tokens, p.tokens).any() for s in salted for p in plain)
    assert same_requests(salted, read_trace(path, salt=1))  # deterministic per salt
    np.testing.assert_array_equal(salted[0].input_tokens[:MOONCAKE_BLOCK_TOKENS],  # sharing inside a file kept
                                  salted[1].input_tokens[:MOONCAKE_BLOCK_TOKENS])


def mooncake_request_strategy():
    """(hash_ids, input_length) with ids from a small alphabet, so lists often share prefixes."""
    return st.lists(st.integers(0, 3), min_size=1, max_size=4).flatmap(
        lambda ids: st.tuples(
            st.just(ids), st.integers((len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + 1, len(ids) * MOONCAKE_BLOCK_TOKENS)
        )
    )


@settings(max_examples=50, deadline=None)
@given(mooncake_request_strategy(), mooncake_request_strategy())
def test_mooncake_shared_hash_prefix_is_shared_token_prefix(tmp_path_factory, a, b):
    (ids_a, length_a), (ids_b, length_b) = a, b
    path = tmp_path_factory.mktemp("mc") / "t.jsonl"
    write_lines(path, [mooncake_row(0, length_a, ids_a), mooncake_row(1, length_b, ids_b)])
    tokens_a, tokens_b = (r.input_tokens for r in read_trace(path))
    common_blocks = next(
        (k for k, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), min(len(ids_a), len(ids_b))
    )
    expected = min(common_blocks * MOONCAKE_BLOCK_TOKENS, length_a, length_b)
    n = min(length_a, length_b)
    mismatches = np.flatnonzero(tokens_a[:n] != tokens_b[:n])
    assert (int(mismatches[0]) if mismatches.size else n) == expected


def splitmix64_reference(key: int) -> int:
    """splitmix64's finaliser on one Python int, written out with explicit mod-2**64 arithmetic."""
    mask = (1 << 64) - 1
    z = (key + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20))
def test_splitmix64_matches_scalar_reference(keys):
    from prefixlab.sim.formats import splitmix64

    assert splitmix64(np.asarray(keys, dtype=np.uint64)).tolist() == [splitmix64_reference(k) for k in keys]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=0, max_size=5), st.data())
def test_mooncake_tokens_match_per_block_reference(hash_ids, data):
    from prefixlab.sim.formats import mooncake_input_tokens

    block = MOONCAKE_BLOCK_TOKENS
    length = data.draw(st.integers(max(0, (len(hash_ids) - 1) * block + 1), len(hash_ids) * block))
    reference = [splitmix64_reference(h * block + j) >> 33 for h in hash_ids for j in range(block)][:length]
    assert mooncake_input_tokens(hash_ids, length).tolist() == reference


def test_write_trace_failing_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    path.write_text("previous contents\n")
    dumps, calls = json.dumps, []

    def failing_dumps(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return dumps(*args, **kwargs)

    monkeypatch.setattr(json, "dumps", failing_dumps)
    with pytest.raises(OSError, match="No space"):
        write_trace(path, [Request("a", 0, 0.0, np.arange(3)), Request("a", 1, 1.0, np.arange(4))])
    monkeypatch.undo()
    assert path.read_text() == "previous contents\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left behind
    write_trace(path, [Request("a", 0, 0.0, np.arange(3))])
    assert [len(r.input_tokens) for r in read_trace(path)] == [3]
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    write_trace(link, [Request("a", 0, 0.0, np.arange(5))])
    assert link.is_symlink() and [len(r.input_tokens) for r in read_trace(path)] == [5]
