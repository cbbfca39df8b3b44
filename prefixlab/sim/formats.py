"""Trace files: read Marconi JSONL or Mooncake JSONL (auto-detected), write Marconi JSONL.

Marconi JSONL, one request a line: ``session_id, turn_id, ts`` (seconds), ``input_tokens``, ``output_tokens``
(token-id lists; the input holds the whole history). Mooncake JSONL: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` — one id per 512-token block, equal ids meaning equal blocks; token ids are
synthesised per hash id so that shared ids give shared token prefixes.
"""

from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prefixlab.errors import InvalidInputError, TraceFormatError, is_int
from prefixlab.sim.trace import Request

MOONCAKE_BLOCK_TOKENS = 512
ON_ERROR_CHOICES = ("stop", "skip")

# splitmix64 constants: a cheap bijective mixer, so distinct (hash id, offset) keys give independent-looking ids.
_MIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_M2 = np.uint64(0x94D049BB133111EB)
# Synthetic ids span 2**31 values so two different blocks practically never share a first token (a spurious hit).
_SYNTHETIC_ID_SHIFT = np.uint64(33)
# Key spaces: input token j of block h is keyed h*512 + j (< 2**63); output token j of request i is keyed
# 2**63 + i*2**32 + j. Both maps are injective and disjoint, so outputs never coincide with input blocks.
MAX_HASH_ID = (1 << 54) - 1
_OUTPUT_KEY_BASE = np.uint64(1 << 63)
_OUTPUT_KEY_STRIDE = np.uint64(1 << 32)
_NO_SALT = np.uint64(0)


class LineError(ValueError):
    """What is wrong with one line; the reader adds file:line."""


def splitmix64(keys: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied elementwise to uint64 keys (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + _MIX_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX_M1
        z = (z ^ (z >> np.uint64(27))) * _MIX_M2
        return z ^ (z >> np.uint64(31))


def synthetic_ids(keys: np.ndarray) -> np.ndarray:
    """Deterministic token ids in [0, 2**31) for uint64 keys: equal keys give equal ids."""
    return (splitmix64(keys) >> _SYNTHETIC_ID_SHIFT).astype(np.int64)


def read_json_lines(path: str | Path, parse: Callable[[Any], Any], on_error: str = "stop") -> Iterator[Any]:
    """Yield `parse(obj)` for each non-blank JSON line; a bad line raises TraceFormatError naming file:line.

    `parse` raises LineError (or KeyError/TypeError/ValueError) to reject a line. With on_error="skip" the line is
    reported with a warning and reading goes on.
    """
    path = existing_file(path, on_error)
    with path.open("rb") as lines:  # bytes: json.loads decodes them, so bad UTF-8 is a bad line, not a crash
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                parsed = parse(obj)  # (first: a parser counts the lines it is given)
                if b"true" in line or b"false" in line:  # (rare: spares the token lists a scan per element)
                    _refuse_bool_lists(obj)
                yield parsed
            except (ValueError, KeyError, TypeError, RecursionError) as err:  # (RecursionError: nesting too deep)
                reason = f"missing field {err}" if isinstance(err, KeyError) else str(err)
                message = f"{path}:{line_number}: {reason}"
                if on_error == "stop":
                    hint = "use on_error='skip' (--on-error skip) to skip such lines"
                    raise TraceFormatError(f"{message} ({hint})") from None
                warnings.warn(f"skipping {message}", stacklevel=2)


ID_LIST_FIELDS = ("input_tokens", "output_tokens", "hash_ids")


def _refuse_bool_lists(obj: Any) -> None:
    """LineError if a list field of the record holds a boolean: numpy would read [true, 2] as token ids [1, 2]."""
    for key in ID_LIST_FIELDS:  # (other list fields are not read: any values there are the writer's business)
        value = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(value, list) and any(isinstance(v, bool) for v in value):
            raise LineError(f"{key} holds a boolean; token and hash ids are integers")


def existing_file(path: str | Path, on_error: str = "stop") -> Path:
    """`path` as a Path after checking it is a file and `on_error` is valid (InvalidInputError otherwise)."""
    if on_error not in ON_ERROR_CHOICES:
        raise InvalidInputError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise InvalidInputError(f"file {str(path)!r} {what}; pass the path of a JSONL file")
    return path


def token_array(values: Any, field: str) -> np.ndarray:
    """A 1-D int64 array of non-negative token ids, or LineError saying what is wrong with `field`."""
    if not isinstance(values, list):
        raise LineError(f"{field} must be a list of token ids, got {type(values).__name__}")
    if not values:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError) as err:
        raise LineError(f"{field} must be a flat list of integer token ids ({err})") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        all_ints = object()  # the default of next(): None is a value a list can hold
        not_int = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), all_ints)
        if not_int is not all_ints:  # else integers numpy holds as objects: beyond 64 bits
            raise LineError(f"{field} must be a flat list of integer token ids, found {not_int!r}")
    if array.dtype.kind not in "iu" or array.min() < 0 or (array.dtype.kind == "u" and
                                                            array.max() > np.iinfo(np.int64).max):
        raise LineError(f"{field} holds a token id out of range (ids are integers in [0, 2**63))")
    return array.astype(np.int64, copy=False)


def _field(obj: Any, name: str, kinds: tuple[type, ...], what: str) -> Any:
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    if name not in obj:
        raise LineError(f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise LineError(f"{name} must be {what}, got {value!r}")
    return value


def _non_negative_int(obj: Any, name: str) -> int:
    value = _field(obj, name, (int,), "a non-negative integer")
    if value < 0:
        raise LineError(f"{name} must be a non-negative integer, got {value}")
    return value


def _finite_number(obj: Any, name: str) -> float:
    value = _field(obj, name, (int, float), "a number")
    try:
        value = float(value)
    except OverflowError:
        raise LineError(f"{name} must be finite, got an integer beyond the range of floats") from None
    if not math.isfinite(value):
        raise LineError(f"{name} must be finite, got {value}")
    return value


def parse_marconi(obj: Any) -> Request:
    """One Marconi JSONL object -> Request (output_tokens may be absent: an empty output)."""
    session_id = _field(obj, "session_id", (str, int), "a string or integer")
    return Request(
        session_id=str(session_id),
        turn_id=_non_negative_int(obj, "turn_id"),
        ts=_finite_number(obj, "ts"),
        input_tokens=token_array(_field(obj, "input_tokens", (list,), "a list of token ids"), "input_tokens"),
        output_tokens=token_array(obj.get("output_tokens", []), "output_tokens"),
    )


MAX_MOONCAKE_OUTPUT_TOKENS = 1 << 24  # 128 MiB of ids for one request; below the 2**32 output keys per request


class MooncakeParser:
    """Mooncake JSONL objects -> Requests. Lines are counted (skipped ones too), so each request's synthetic
    output tokens depend only on its position in the file."""

    def __init__(self, salt: int = 0) -> None:
        self.num_seen = 0
        self.salt_key = _salt_key(salt)

    def __call__(self, obj: Any) -> Request:
        index, self.num_seen = self.num_seen, self.num_seen + 1
        input_length = _non_negative_int(obj, "input_length")
        output_length = _non_negative_int(obj, "output_length")
        if output_length > MAX_MOONCAKE_OUTPUT_TOKENS:  # (each is a synthetic token the reader builds)
            raise LineError(f"output_length must be at most 2**24 tokens (a generation, not a corpus), got "
                            f"{output_length}")
        timestamp_ms = _finite_number(obj, "timestamp")
        hash_ids = _field(obj, "hash_ids", (list,), "a list of block hash ids")
        num_blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) != num_blocks:
            raise LineError(
                f"hash_ids has {len(hash_ids)} ids but input_length {input_length} needs "
                f"ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {num_blocks}"
            )
        if any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID for h in hash_ids):
            raise LineError(f"hash_ids must be integers in [0, 2**54), got {hash_ids[:8]!r}...")
        with np.errstate(over="ignore"):
            output_keys = (
                _OUTPUT_KEY_BASE + np.uint64(index) * _OUTPUT_KEY_STRIDE + np.arange(output_length, dtype=np.uint64)
            )
        return Request(
            session_id=f"mooncake-{index}",
            turn_id=0,
            ts=timestamp_ms / 1000.0,
            input_tokens=mooncake_input_tokens(hash_ids, input_length, self.salt_key),
            output_tokens=synthetic_ids(output_keys ^ self.salt_key),
        )


def mooncake_input_tokens(hash_ids: list[int], input_length: int, salt_key: np.uint64 = _NO_SALT) -> np.ndarray:
    """Concatenated synthetic blocks for `hash_ids`, the last one cut to `input_length` (`salt_key`: _salt_key)."""
    blocks = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    offsets = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)[None, :]
    keys = (blocks * np.uint64(MOONCAKE_BLOCK_TOKENS) + offsets) ^ salt_key
    return synthetic_ids(keys).reshape(-1)[:input_length]


def _salt_key(salt: int) -> np.uint64:
    """What a Mooncake file's keys are XORed with: its hash ids name blocks of that file only, so files read
    together (a mix) must not share blocks by chance; salt 0 (one file alone) changes nothing."""
    if not is_int(salt) or salt < 0:
        raise InvalidInputError(f"salt must be an int >= 0, got {salt!r}")
    return _NO_SALT if salt == 0 else splitmix64(np.array([salt], dtype=np.uint64))[0]


def detect_format(path: str | Path) -> str:
    """'marconi' or 'mooncake', from the first non-blank line that is a JSON object; TraceFormatError otherwise."""
    path = existing_file(path)
    with path.open("rb") as lines:
        for line in lines:
            try:
                obj = json.loads(line) if line.strip() else None
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict) and "hash_ids" in obj:
                return "mooncake"
            if isinstance(obj, dict) and "input_tokens" in obj:
                return "marconi"
    raise TraceFormatError(
        f"{path}: no line looks like a trace record; expected Marconi JSONL (session_id, turn_id, ts, input_tokens, "
        "output_tokens) or Mooncake JSONL (timestamp, input_length, output_length, hash_ids)"
    )


def read_trace(path: str | Path, on_error: str = "stop", salt: int = 0) -> list[Request]:
    """Requests of a Marconi or Mooncake JSONL trace (format auto-detected), in arrival order (stable by ts).
    `salt`: a Mooncake trace's synthetic tokens for each distinct salt share no block with another salt's (give
    each file of a mix its own); Marconi traces hold real token ids and ignore it."""
    existing_file(path, on_error)
    parse = MooncakeParser(salt) if detect_format(path) == "mooncake" else parse_marconi
    requests = list(read_json_lines(path, parse, on_error))
    return sorted(requests, key=lambda r: r.ts)


def marconi_record(request: Request) -> dict[str, Any]:
    """The Marconi JSONL object of one request (num_* fields included for readers that want counts only)."""
    return {
        "session_id": request.session_id,
        "turn_id": int(request.turn_id),
        "ts": float(request.ts),
        "num_input_tokens": int(len(request.input_tokens)),
        "num_output_tokens": int(len(request.output_tokens)),
        "input_tokens": np.asarray(request.input_tokens).tolist(),
        "output_tokens": np.asarray(request.output_tokens).tolist(),
    }


def write_trace(path: str | Path, requests: list[Request]) -> None:
    """Write `requests` as Marconi JSONL (one object a line). The file is replaced atomically: a failure midway
    leaves the previous file as it was and no temporary file behind."""
    for index, request in enumerate(requests):
        if not isinstance(request, Request):
            raise InvalidInputError(f"requests[{index}] is a {type(request).__name__}; write_trace takes Requests")
        if not math.isfinite(request.ts):
            raise InvalidInputError(f"requests[{index}].ts={request.ts} is not a finite arrival time (seconds); JSON "
                                    "has no NaN or Infinity and read_trace refuses them")
        for name in ("input_tokens", "output_tokens"):
            tokens = np.asarray(getattr(request, name))
            if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
                raise InvalidInputError(
                    f"requests[{index}].{name} must be a 1-D integer array, got dtype {tokens.dtype} "
                    f"shape {tokens.shape}"
                )
        if not is_int(request.turn_id):
            raise InvalidInputError(f"requests[{index}].turn_id={request.turn_id!r} must be an int")
    records = [marconi_record(r) for r in requests]  # all converted (and read back) before the file is opened
    for index, record in enumerate(records):
        try:
            parse_marconi(record)
        except (LineError, ValueError, TypeError, KeyError) as err:
            raise InvalidInputError(f"requests[{index}]: {err}; read_trace would refuse that line, so nothing was "
                                    "written") from None
    path = Path(path).resolve()  # a symlink's target: the rename must not replace the link itself
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with temporary.open("w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, separators=(",", ":")))
                out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
