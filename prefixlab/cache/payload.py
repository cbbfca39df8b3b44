"""Payloads the radix tree stores. The tree only needs byte sizes and, for attention KV, split/concat.

The simulator stores `SizedKV` / `SizedState` (sizes only); the Hugging Face glue stores tensors that follow the
same protocol, so one policy code path serves both.
"""

from __future__ import annotations

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
