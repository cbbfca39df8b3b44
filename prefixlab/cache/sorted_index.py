"""SortedIndex: node ids ordered by a key, the eviction policies' candidate indexes (eviction.py)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, KeysView


class SortedIndex:
    """Node ids ordered by a key (ties by id); O(log n) search, memmove-cheap insert/delete."""

    def __init__(self) -> None:
        self._entries: list[tuple] = []
        self._key_of: dict[int, tuple] = {}

    def put(self, node_id: int, key: tuple) -> None:
        old = self._key_of.get(node_id)
        if old == key:
            return
        if old is not None:
            del self._entries[bisect.bisect_left(self._entries, (*old, node_id))]
        bisect.insort(self._entries, (*key, node_id))
        self._key_of[node_id] = key

    def put_many(self, items: dict[int, tuple]) -> None:
        """`put` of many ids at once: one sort instead of an insertion (a list move) each."""
        entries = [entry for entry in self._entries if entry[-1] not in items]
        entries.extend((*key, node_id) for node_id, key in items.items())
        entries.sort()
        self._entries = entries
        self._key_of.update(items)

    def discard(self, node_id: int) -> None:
        key = self._key_of.pop(node_id, None)
        if key is not None:
            del self._entries[bisect.bisect_left(self._entries, (*key, node_id))]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._key_of

    def ids(self) -> KeysView[int]:
        """The indexed ids (a live view: `in` without a method call, for hot loops)."""
        return self._key_of.keys()

    def __reversed__(self) -> Iterator[tuple]:
        return reversed(self._entries)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._entries)

    def copy(self) -> SortedIndex:
        twin = SortedIndex()
        twin._entries, twin._key_of = list(self._entries), dict(self._key_of)
        return twin

    def first(self) -> tuple:
        return self._entries[0]

    def last(self) -> tuple:
        return self._entries[-1]
