"""Output files of `prefixlab run`: resumable, never silently overwritten.

Each process appends one JSON line per finished prompt to its own part file `OUT.part<rank>` (flushed per line,
so a process that dies keeps what it finished). At the end the main process merges OUT (a previous run's
results) and every part file into OUT, in prompt-file order, and removes the parts. A rerun reads OUT and any
leftover parts and skips the ids found there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from prefixlab.errors import InvalidInputError


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.part{rank}")


def part_files(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.part*"))


def _records(path: Path) -> Iterable[dict]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise InvalidInputError(f"{path}:{number} is not a JSON line; it is not a prefixlab run output "
                                            "(move it away or pass another --out)") from None
                continue  # a last line cut short by a process that died while writing it: redone
            if not isinstance(record, dict) or "id" not in record:
                raise InvalidInputError(f"{path}:{number} has no 'id'; it is not a prefixlab run output "
                                        "(move it away or pass another --out)")
            yield record


def finished(out: Path) -> dict[str | int, dict]:
    """Records already written for `out` (its merged file and leftover part files), by id."""
    done: dict[str | int, dict] = {}
    for path in [out] * out.is_file() + part_files(out):
        for record in _records(path):
            done.setdefault(record["id"], record)
    return done


class PartWriter:
    """Appends finished records to one process's part file, one flushed line each."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = part_path(out, rank)
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def merge(out: Path, ids_in_order: list[str | int]) -> tuple[int, list[str | int]]:
    """Rewrite `out` with every finished record in prompt-file order (records of ids no longer in the file go
    last), remove the part files; returns (records written, ids of `ids_in_order` still missing)."""
    done = finished(out)
    order = {prompt_id: k for k, prompt_id in enumerate(ids_in_order)}
    records = sorted(done.values(), key=lambda r: order.get(r["id"], len(order)))
    temporary = out.with_name(out.name + ".merging")
    with open(temporary, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    os.replace(temporary, out)  # atomic: a crash here leaves the old OUT and the parts, both still readable
    for path in part_files(out):
        path.unlink()
    return len(records), [prompt_id for prompt_id in ids_in_order if prompt_id not in done]
