"""The prefix cache's invariants, recomputed from scratch (tests and randomized checks call them after every step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixlab.cache.core import PrefixCacheCore


def check_core_invariants(core: PrefixCacheCore) -> None:
    """A PrefixCacheCore's bytes, locks and eviction index against a recount; AssertionError on any drift."""
    core.tree.check_invariants()
    over = core.used_bytes > core.capacity_bytes
    assert not over or core.overflow, f"used {core.used_bytes} > capacity {core.capacity_bytes}"
    locks: dict[int, int] = {}
    for match in core._live.values():
        for node in match.node.ancestors():
            locks[node.id] = locks.get(node.id, 0) + 1
    for node in core.tree.nodes():
        assert node.lock_count == locks.get(node.id, 0), f"{node} lock count {node.lock_count} != live matches"
        assert (node.id in core.eviction.nodes) == core.eviction.eligible(node), f"{node} eviction index stale"

