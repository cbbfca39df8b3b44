"""Output files of `prefixlab run`: resumable, never silently overwritten.

Each process appends one JSON line per finished prompt to its own part file `OUT.part<rank>` (one write() of the
whole line, so a process that dies keeps what it finished and leaves at most its last line cut short). At the end
the main process merges OUT (a previous run's results) and every part file into OUT, in prompt-file order, and
removes the parts. A rerun (or a restarted process group) reads OUT and any leftover parts and skips the ids found
there. A process that dies at any point of a merge loses nothing: OUT is replaced atomically and the parts are
removed only after it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from prefixlab.errors import InvalidInputError


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.part{rank}")


def part_files(out: Path) -> list[Path]:
    """This run's own part files, OUT.part<rank> (not a glob: OUT's name may hold `*`, `?` or `[`, and another
    file may merely start with OUT's name)."""
    own = re.compile(re.escape(out.name) + r"\.part\d+")
    folder = out.parent if str(out.parent) else Path(".")
    return sorted(path for path in folder.iterdir() if own.fullmatch(path.name) and path.is_file()) \
        if folder.is_dir() else []


def _records(path: Path) -> Iterable[dict]:
    with open(path, "rb") as lines:  # bytes: json.loads decodes them (a BOM too), so bad UTF-8 is a bad line
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # json.JSONDecodeError, UnicodeDecodeError, nesting too deep
                if line.endswith(b"\n"):
                    raise InvalidInputError(f"{path}:{number} is not a JSON line; it is not a prefixlab run output "
                                            "(move it away or pass another --out)") from None
                continue  # a last line cut short by a process that died while writing it: redone
            prompt_id = record.get("id") if isinstance(record, dict) else None
            if isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int) \
                    or not isinstance(record.get("output_ids"), list):  # (a prompt file has ids too)
                raise InvalidInputError(f"{path}:{number} is not a prefixlab run output (a record with a string or "
                                        "int 'id' and a list 'output_ids'); move it away or pass another --out")
            yield record


def finished(out: Path) -> dict[str | int, dict]:
    """Records already written for `out` (its merged file and leftover part files), by id."""
    done: dict[str | int, dict] = {}
    for path in [out] * out.is_file() + part_files(out):
        for record in _records(path):
            done.setdefault(record["id"], record)
    return done


def _complete_last_line(path: Path) -> None:
    """End `path` on a line break, as `_records` read it: a last line cut short (a process killed while writing it)
    is cut off; a last line that is a whole record missing only its line break gets one. Appending after either
    would otherwise glue two records into one line that is not JSON. Reads only the last line."""
    with open(path, "rb+") as file:
        end = file.seek(0, os.SEEK_END)
        start, tail = end, b""
        while start > 0 and b"\n" not in tail:  # back from the end, block by block, to the last line break
            step = min(1 << 16, start)
            start -= step
            file.seek(start)
            tail = file.read(step) + tail
        if not tail or tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n") + 1
        try:
            whole = isinstance(json.loads(tail[cut:]), dict)
        except (ValueError, RecursionError):  # json.JSONDecodeError, UnicodeDecodeError, nesting too deep
            whole = False
        if whole:
            file.seek(end)
            file.write(b"\n")
        else:
            file.truncate(start + cut)


_CLAIMS: dict[Path, object] = {}  # OUT -> the open lock file this process holds


def claim(out: Path) -> None:
    """Hold OUT for this run: an exclusive lock on OUT.lock (nothing where there is no fcntl), released by
    `release` or when the process ends. Two runs with one --out at once would append to the same part files."""
    try:
        import fcntl
    except ImportError:
        return
    path = out.with_name(out.name + ".lock")
    while True:
        try:
            handle = open(path, "a")  # noqa: SIM115 (held across the run)
        except OSError as err:
            raise InvalidInputError(f"cannot write next to {out} ({err.strerror}); pass an --out in a folder you "
                                    "can write to") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise InvalidInputError(f"{out} is being written by another prefixlab run ({out.name}.lock is held); "
                                    "wait for it to finish or pass another --out") from None
        # a run ending unlinks the file before it lets go: a lock on that unlinked file would not exclude the next
        # run, which creates a new OUT.lock; the lock counts only while the file is still the one at OUT.lock
        try:
            now, held = os.stat(path), os.fstat(handle.fileno())
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                break
        except FileNotFoundError:
            pass
        handle.close()
    _CLAIMS[out] = handle


def release(out: Path | None = None) -> None:
    """Let go of `claim`'s lock on `out` and remove its file (every claim of this process without `out`)."""
    for path in [out] if out is not None else list(_CLAIMS):
        handle = _CLAIMS.pop(path, None)
        if handle is not None:
            path.with_name(path.name + ".lock").unlink(missing_ok=True)
            handle.close()


class PartWriter:
    """Appends finished records to one process's part file: one unbuffered write() per line."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = part_path(out, rank)
        if self.path.is_file():  # left by a process of a previous run or attempt with this rank
            _complete_last_line(self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        while line:  # a regular file takes it in one call; loop only on a short write
            line = line[os.write(self.fd, line):]

    def close(self) -> None:
        os.close(self.fd)


def merge(out: Path, ids_in_order: list[str | int], remove_parts: bool = True) -> tuple[int, list[str | int]]:
    """Rewrite `out` with every finished record in prompt-file order (records of ids no longer in the file go
    last), then remove the part files (keep them with `remove_parts=False`: a stopped run whose other processes
    may still append to theirs); returns (records of the file's ids written, ids of `ids_in_order` still missing)."""
    done = finished(out)
    order = {prompt_id: k for k, prompt_id in enumerate(ids_in_order)}
    records = sorted(done.values(), key=lambda r: order.get(r["id"], len(order)))
    if others := sum(record["id"] not in order for record in records):
        print(f"prefixlab: note: {out} holds {others} records of ids not in this prompt file (another file's run?); "
              "they are kept after this file's records", file=sys.stderr)
    temporary = out.with_name(out.name + ".merging")
    with open(temporary, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
        file.flush()
        os.fsync(file.fileno())  # on disk before it replaces OUT: the parts are removed next
    os.replace(temporary, out)  # atomic: a crash here leaves the old OUT and the parts, both still readable
    for path in part_files(out) if remove_parts else ():
        path.unlink()  # a crash between two unlinks leaves records in OUT and a part: read once (by id)
    return len(records) - others, [prompt_id for prompt_id in ids_in_order if prompt_id not in done]
