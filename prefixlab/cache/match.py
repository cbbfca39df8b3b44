"""What a request gets from PrefixCacheCore: a `Match` (what it can reuse) and an `Admission` (what was stored)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixlab.cache.payload import KVPayload, Payload
from prefixlab.cache.tree import Node, Walk


@dataclass(eq=False)
class Match:
    """What a request can reuse: KV[:length] and the state at `length` (None at 0 or for KV-only models).

    `shared_length` is how many tokens the tree shares with the request (>= length). The entries are locked
    until `core.release(match)`."""

    length: int
    shared_length: int
    state: Payload | None
    kv: list[KVPayload]
    namespace: str
    input_length: int
    node: Node = field(repr=False)
    walk: Walk = field(repr=False)


@dataclass(frozen=True)
class Admission:
    """What `admit` stored: new tokens (KV) and new checkpoints; falsy when the budget refused the whole entry."""

    tokens: int
    states: int
    refused: bool = False

    def __bool__(self) -> bool:
        return not self.refused
