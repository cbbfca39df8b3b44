"""Admission policies: which recurrent-state checkpoints a request should capture and the cache keep.

- `BlockAdmission` (vllm+): a state every `block_size` tokens and at the end of the sequence; when a later
  sequence extends a partial last block, the old end state is superseded once a deeper state of that sequence is
  held (vLLM+ fills the block in place).
- `MarconiAdmission` (sglang+, marconi): the state after the last token, plus the state at the branch point when
  the speculative insertion of the sequence would split an existing edge (Marconi section 4.1).
- `PlacedAdmission` (marconi+balanced|block|log): Marconi's positions plus checkpoints placed inside the part of
  the sequence the request computes anyway. dp's priced placement is `prefixlab.cache.priced.PricedAdmission`.

`refresh_path` says how hits refresh timestamps: SGLang / vLLM refresh every node on the matched path, Marconi
only the node whose checkpoint is reused (section 4.3).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixlab.cache.tree import Node, RadixTree, Walk


def _has_checkpoint_at(walk: Walk, position: int) -> bool:
    node = walk.path[-1]
    i = node.checkpoint_at_or_before(position)
    return i >= 0 and node.ckpt_pos[i] == position


class MarconiAdmission:
    """Branch point (speculative insertion) and the last token."""

    refresh_path = False

    def plan(self, walk: Walk, length: int, reused: int, input_length: int = 0) -> list[int]:
        """Positions in (reused, length] whose states a request should capture: `walk` is its tokens' walk of the
        tree, `length` how many it stores (input + output), `input_length` its input's (0: unknown)."""
        shared = walk.shared_length
        positions = {length} if length > reused else set()
        if reused < shared < length and not _has_checkpoint_at(walk, shared):
            positions.add(shared)
        return sorted(positions)

    def observe(self, walk: Walk, reused_length: int) -> None:
        """Called with every request's walk of the tree (its input) and the part of it a checkpoint let it reuse."""

    def before_admit(self, walk: Walk) -> None:
        """Called as an admission starts, with its tokens' walk of the tree as it is then (requests may interleave
        between a plan and its admission: what the admission needs is taken here, not kept from the plan)."""

    def after_admit(self, tree: RadixTree, deepest: Node, length: int, locked: frozenset[int] = frozenset(),
                    restore: bool = False) -> None:
        """Housekeeping once a sequence was admitted: the tree holds its first `length` tokens, the last of them on
        `deepest`'s edge; states whose id() is in `locked` are held by live matches and must stay; `restore`: a
        saved or moved entry, not a new sequence (it supersedes nothing)."""

    def seed(self, other: MarconiAdmission) -> None:
        """Start from what `other` (a live cache's admission) learned about the workload (the alpha tuner's
        replays: a fresh cache that places states as the live one does now)."""


class SGLangAdmission(MarconiAdmission):
    """SGLang+ = Marconi's admission with SGLang's LRU bookkeeping (every node on a hit path is refreshed)."""

    refresh_path = True


class BlockAdmission(MarconiAdmission):
    """vLLM+: every block boundary and the sequence end."""

    refresh_path = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def plan(self, walk: Walk, length: int, reused: int, input_length: int = 0) -> list[int]:
        first = (reused // self.block_size + 1) * self.block_size
        positions = list(range(first, length + 1, self.block_size))
        return positions + [length] if length > reused and length % self.block_size else positions

    def after_admit(self, tree: RadixTree, deepest: Node, length: int, locked: frozenset[int] = frozenset(),
                    restore: bool = False) -> None:
        if restore:
            return
        # A state inside a block is superseded once the sequence goes on past it with a deeper state held on its own
        # path: an entry cut to fit (or stored without its extension) supersedes nothing it did not store.
        path = deepest.ancestors()[:-1]
        deepest_held = max((p for node in path for p in node.ckpt_pos if p <= length), default=0)
        for node in path:
            stale = [i for i, (p, state) in enumerate(zip(node.ckpt_pos, node.ckpt_state, strict=True))
                     if p < deepest_held and p % self.block_size and id(state) not in locked]
            for i in reversed(stale):
                tree.drop_checkpoints(node, i, i + 1)


class PlacedAdmission(MarconiAdmission):
    """Marconi's positions plus `placement(reused, length)` positions strictly inside (reused, length): the
    request computes those tokens anyway, so their states cost only memory."""

    def __init__(self, placement: Callable[[int, int], list[int]]) -> None:
        self.placement = placement

    def plan(self, walk: Walk, length: int, reused: int, input_length: int = 0) -> list[int]:
        placed = [p for p in self.placement(reused, length) if reused < p < length] if length > reused + 1 else []
        return sorted(set(super().plan(walk, length, reused)).union(placed))
