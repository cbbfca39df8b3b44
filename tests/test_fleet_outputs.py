"""`prefixlab run`'s OUT file: part files cut at whole lines, merged in input order; a symlink, a pipe or an
unwritable path."""

import json
import os

import pytest
from test_fleet_run import files, read_out, reference  # noqa: F401  (files, reference: the module fixtures)

from prefixlab.cli import main
from prefixlab.fleet import outputs


def test_part_files_end_on_whole_lines(tmp_path, reference):  # noqa: F811
    """A process killed while writing leaves its last line cut short: the next writer of that part cuts it off
    (the prompt is redone); a whole last record missing only its line break is kept."""
    out = tmp_path / "out.jsonl"
    records = [{"id": prompt_id, "output_ids": ids} for prompt_id, ids in reference.items()]
    for last, kept in ((json.dumps(records[2])[:-5], 2), (json.dumps(records[2]), 3)):
        outputs.part_path(out, 1).write_text("".join(json.dumps(r) + "\n" for r in records[:2]) + last)
        assert len(outputs.finished(out)) == kept  # what the main process plans with...
        writer = outputs.PartWriter(out, 1)
        writer.write(records[3])
        writer.close()
        assert list(outputs.finished(out)) == [r["id"] for r in records[:kept]] + [records[3]["id"]]  # ...and keeps
    # a stopped run merges without removing the parts (the other processes may still append to theirs)
    assert outputs.merge(out, list(reference), remove_parts=False)[0] == 4 and outputs.part_files(out)
    assert outputs.merge(out, list(reference))[0] == 4 and not outputs.part_files(out)
    assert [r["id"] for r in read_out(out)] == [r["id"] for r in records[:4]]


def test_out_through_a_symlink_updates_its_target_and_a_pipe_is_refused(capsys, files, tmp_path):  # noqa: F811
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join((files / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    args = ["run", prompts, "--model", files / "config.json", "--max-new-tokens", "1", "--out"]
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("")
    link.symlink_to(target)
    assert main([*args, link]) == 0
    assert link.is_symlink() and len(read_out(target)) == 2  # the target holds the results, the link stays a link
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    assert main([*args, pipe]) == 2
    assert "not a regular file" in capsys.readouterr().err and pipe.is_fifo()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc, where no file can be created")
def test_an_out_that_cannot_be_written_is_a_clear_error(capsys, files):  # noqa: F811
    assert main(["run", files / "prompts.jsonl", "--model", files / "config.json", "--out", "/proc/out.jsonl"]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix", reason="OUT.lock is an flock (POSIX)")
def test_a_claim_racing_the_end_of_another_run_still_excludes_a_third(tmp_path, monkeypatch):
    """A run ends by unlinking OUT.lock, then closing it: a run that opened the file just before (the old inode) and
    locked it just after held a lock on a file no longer at OUT.lock, so a third run created a new OUT.lock, locked it
    too, and two runs appended to the same part files."""
    import fcntl

    out = tmp_path / "out.jsonl"
    path = tmp_path / "out.jsonl.lock"
    ending = open(path, "a")  # noqa: SIM115 (an earlier run, holding OUT)
    fcntl.flock(ending, fcntl.LOCK_EX | fcntl.LOCK_NB)
    real_flock = fcntl.flock

    def flock_after_the_earlier_run_ends(handle, operation):
        if not ending.closed:  # the earlier run's release() lands between this claim's open and its flock
            path.unlink()
            ending.close()
        return real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_earlier_run_ends)
    try:
        outputs.claim(out)
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with open(path, "a") as third, pytest.raises(OSError):  # a third run's claim must find OUT taken
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        outputs.release(out)
    assert not path.exists()
