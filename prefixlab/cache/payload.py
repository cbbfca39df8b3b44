"""Payloads the radix tree stores. The tree only needs byte sizes and, for attention KV, split/concat.

The simulator stores `SizedKV` / `SizedState` (sizes only); the Hugging Face glue stores tensors that follow the
same protocol, so one policy code path serves both.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class Payload(Protocol):
    """Anything with an exact size in bytes (a recurrent-state checkpoint, for instance)."""

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class KVPayload(Payload, Protocol):
    """Attention KV for a run of tokens; `split(at)` cuts it after `at` tokens, `concat` joins a following run."""

    @property
    def ntokens(self) -> int: ...

    def split(self, at: int) -> tuple[KVPayload, KVPayload]: ...

    def concat(self, other: KVPayload) -> KVPayload: ...


@dataclass(frozen=True, slots=True)
class SizedState:
    """A recurrent-state checkpoint known only by its size (simulator)."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class SizedKV:
    """Attention KV known only by its size (simulator): `ntokens * bytes_per_token` bytes."""

    ntokens: int
    bytes_per_token: int

    @property
    def nbytes(self) -> int:
        return self.ntokens * self.bytes_per_token

    def split(self, at: int) -> tuple[SizedKV, SizedKV]:
        return SizedKV(at, self.bytes_per_token), SizedKV(self.ntokens - at, self.bytes_per_token)

    def concat(self, other: SizedKV) -> SizedKV:
        return SizedKV(self.ntokens + other.ntokens, self.bytes_per_token)


def entry_bytes(kv: KVPayload | None, states: list[tuple[int, Payload]]) -> int:
    """Bytes of an entry: its KV and its (position, state) checkpoints."""
    return (kv.nbytes if kv is not None else 0) + sum(s.nbytes for _, s in states)


def fitting_prefix(room: int, ends: list[int], kv: KVPayload | None, states: list[tuple[int, Payload]], shared: int,
                   keep_end: int) -> tuple[KVPayload | None, list[tuple[int, Payload]], int]:
    """The longest (kv, states, end) prefix of an entry (KV for tokens [shared, keep_end), sorted checkpoints) that
    fits in `room` bytes, cut at one of the sorted `ends`; (None, [], shared) if none does."""

    def part(end: int) -> KVPayload | None:
        if kv is None or end <= shared:
            return None
        return kv if end == keep_end else kv.split(end - shared)[0]

    def cost(end: int) -> int:
        return entry_bytes(part(end), [(p, s) for p, s in states if p <= end])

    fits = bisect.bisect_right(ends, room, key=cost)
    if fits == 0:
        return None, [], shared
    end = ends[fits - 1]
    return part(end), [(p, s) for p, s in states if p <= end], max(end, shared)
