"""`prefixlab run`'s files read line by line: a prompt file's bad lines and an OUT file that is not one of its
outputs (no model runs here; tests/test_fleet_run.py runs it)."""

import pytest

from prefixlab.errors import InvalidInputError
from prefixlab.fleet import outputs
from prefixlab.fleet.prompts import read_prompts


def test_a_token_id_beyond_64_bits_is_a_bad_line(tmp_path):
    bad = tmp_path / "huge.jsonl"
    bad.write_text('{"id": 1, "input_ids": [5, 99999999999999999999999]}\n{"id": 2, "input_ids": [5, 6]}\n')
    with pytest.raises(InvalidInputError, match=rf"{bad}:1: 'input_ids' must be a list of token ids"):
        read_prompts(bad, vocab_size=128)
    assert [p.id for p in read_prompts(bad, on_error="skip")] == [2]


def test_an_output_record_whose_id_is_not_a_prompt_id_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    for record in ('{"id": [1]}', '{"id": {"a": 1}}', '{"id": null}', '{"id": true}'):
        out.write_text(record + "\n")
        with pytest.raises(InvalidInputError, match="not a prefixlab run output"):
            outputs.finished(out)


def test_an_output_file_that_is_not_utf8_is_refused_and_a_bom_is_read(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'\xff\xfe{"id": 1}\n')
    with pytest.raises(InvalidInputError, match="not a prefixlab run output"):
        outputs.finished(out)
    out.write_bytes(b'\xef\xbb\xbf{"id": 1, "output_ids": [8]}\n{"id": 2, "output_ids": [9]}\n')  # saved by an editor
    assert list(outputs.finished(out)) == [1, 2]
