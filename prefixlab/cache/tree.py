"""Radix tree over token ids. An edge holds the attention KV of its tokens and any number of recurrent-state
checkpoints at positions inside it or at its end; payloads are opaque (only `nbytes` and KV split/concat are used).

Positions are absolute token depths: a node's edge covers tokens [start, end) of every sequence through it and a
checkpoint at p is the state after the first p tokens (start < p <= end). The tree only does structure and exact
byte accounting; which checkpoints to keep and what to evict is decided by the policies. Every change to a node
that a policy may rank by (timestamp, children, checkpoints, edge) is reported through `on_change`, every
removal through `on_remove`, so policies keep sorted indexes instead of scanning the tree. Locks are not
reported: they are short-lived, so policies skip locked nodes when they pick.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prefixlab.cache.namespaces import NamespaceIndex
from prefixlab.cache.payload import KVPayload, Payload


class Node:
    """One edge of the tree: tokens [start, end), their KV, checkpoints inside (start, end]."""

    __slots__ = ("id", "parent", "children", "tokens", "start", "kv", "ckpt_pos", "ckpt_state", "last_access",
                 "lock_count", "namespace", "branched", "truncated", "resumed", "recent_resumes", "resumed_at")

    def __init__(self, node_id: int, parent: Node | None, tokens: np.ndarray, start: int, kv: KVPayload | None,
                 last_access: int, namespace: str):
        self.id = node_id
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tokens = tokens
        self.start = start
        self.kv = kv
        self.ckpt_pos: list[int] = []
        self.ckpt_state: list[Payload] = []
        self.last_access = last_access
        self.lock_count = 0
        self.namespace = namespace
        self.branched = False  # its end was a divergence point (it is the upper part of a split)
        self.truncated = False  # a leaf cut short of the sequence it was admitted for (a budget's cut, a trim)
        self.resumed = 0  # requests that resumed from its end's state since its end became a branch point
        # the same requests decayed by age (an eviction policy's, as of clock `resumed_at`: dp's ThinningFlopAware)
        self.recent_resumes, self.resumed_at = 0.0, 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.ckpt_state)

    def checkpoint_at_or_before(self, position: int) -> int:
        """Index of the deepest checkpoint at or before `position`, or -1."""
        return bisect.bisect_right(self.ckpt_pos, position) - 1

    def ancestors(self) -> list[Node]:
        """This node and its ancestors up to the root (included)."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out

    def __repr__(self) -> str:
        return f"Node(id={self.id}, [{self.start}, {self.end}), ckpts={self.ckpt_pos}, children={len(self.children)})"


@dataclass(slots=True)
class Walk:
    """Where `tokens` leave the tree: `path` from the root (the last node may be only partly shared), the
    number of tokens shared with the tree and the number of tokens walked."""

    path: list[Node]
    shared_length: int
    walked: int

    def has_checkpoint(self, position: int) -> bool:
        """Whether a node on the path holds a checkpoint exactly at `position`."""
        for node in self.path[1:]:
            if node.start < position <= node.end:
                i = node.checkpoint_at_or_before(position)
                return i >= 0 and node.ckpt_pos[i] == position
        return False

    @property
    def ends_inside_edge(self) -> bool:
        last = self.path[-1]
        return not last.is_root and self.shared_length < last.end


class RadixTree:
    """The tree: one root per namespace holding entries (a namespace's root is registered by its first leaf and
    dropped with its last, so namespaces only looked up leave nothing behind), exact byte accounting, structural
    edits used by the policies."""

    def __init__(self) -> None:
        self._next_id = 0
        self.roots: dict[str, Node] = {}
        self.kv_bytes = 0
        self.state_bytes = 0
        self.num_checkpoints = 0
        self.version = 0  # bumped by every edit that can change a walk
        self.on_change: Callable[[Node], None] = lambda node: None
        self.on_remove: Callable[[Node], None] = lambda node: None
        self._namespaces: NamespaceIndex | None = None  # built on first use (namespace_index)

    @property
    def used_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def copy(self) -> tuple[RadixTree, dict[int, Node]]:
        """An independent copy with the same node ids, and its nodes by id. Token arrays and payloads are shared:
        the tree never writes into them (edits slice or concatenate), and payloads are immutable."""
        twin = RadixTree()
        twin._next_id, twin.version = self._next_id, self.version
        twin.kv_bytes, twin.state_bytes, twin.num_checkpoints = self.kv_bytes, self.state_bytes, self.num_checkpoints
        nodes: dict[int, Node] = {}

        def clone(node: Node, parent: Node | None) -> Node:
            new = Node(node.id, parent, node.tokens, node.start, node.kv, node.last_access, node.namespace)
            new.ckpt_pos, new.ckpt_state, new.lock_count = list(node.ckpt_pos), list(node.ckpt_state), node.lock_count
            new.branched, new.truncated, new.resumed = node.branched, node.truncated, node.resumed
            new.recent_resumes, new.resumed_at = node.recent_resumes, node.resumed_at
            nodes[node.id] = new
            return new

        stack = []
        for namespace, root in self.roots.items():
            twin.roots[namespace] = clone(root, None)
            stack.append((root, twin.roots[namespace]))
        while stack:
            node, new = stack.pop()
            for key, child in node.children.items():  # in order: children dicts keep their insertion order
                new.children[key] = clone(child, new)
                stack.append((child, new.children[key]))
        return twin, nodes

    def namespace_index(self) -> NamespaceIndex:
        """Every namespace's leaf paths in one trie (cache/namespaces.py), built now if not yet, kept in step since."""
        if self._namespaces is None:
            self._namespaces = NamespaceIndex()
            for node in self.nodes():
                if not node.is_root and not node.children:
                    self._namespaces.add(node.namespace, path_tokens(node))
        return self._namespaces

    def root(self, namespace: str) -> Node:
        """The namespace's root; an empty, unregistered one if it holds nothing (`add_leaf` registers it)."""
        root = self.roots.get(namespace)
        if root is None:
            root = Node(self._new_id(), None, np.zeros(0, dtype=np.int64), 0, None, 0, namespace)
        return root

    def walk(self, tokens: np.ndarray, namespace: str, resume: Walk | None = None) -> Walk:
        """Follow `tokens` down from the namespace root as far as they match (numpy compare per edge). `resume`,
        a walk of a prefix of `tokens` in the unchanged tree, is continued instead of starting from the root."""
        total = len(tokens)
        if resume is None:
            node = self.roots.get(namespace)
            if node is None:
                return Walk([self.root(namespace)], 0, total)
            path, depth = [node], 0
        else:
            path, depth = list(resume.path), resume.shared_length
            if depth < resume.walked:  # the prefix already left the tree
                return Walk(path, depth, total)
            if depth < path[-1].end:  # it ended inside an edge: compare that edge again
                path.pop()
                depth = path[-1].end
            node = path[-1]
        while depth < total:
            child = node.children.get(tokens.item(depth))
            if child is None:
                break
            edge = child.tokens
            n = min(len(edge), total - depth)
            ours, theirs = edge[:n], tokens[depth:depth + n]
            if ours.tobytes() == theirs.tobytes():  # edges mostly match whole: a byte compare settles it fastest
                matched = n
            else:
                differs = ours != theirs
                matched = int(differs.argmax()) if differs.any() else n  # any(): equal ids of another int dtype
            path.append(child)
            depth += matched
            if matched < len(edge):
                break
            node = child
        return Walk(path, depth, total)

    @staticmethod
    def deepest_checkpoint(walk: Walk, limit: int | None = None) -> tuple[Node, int, Payload | None]:
        """(node, position, state) of the deepest checkpoint at or before the shared length (and `limit`); (root, 0,
        None) if none."""
        bound = walk.shared_length if limit is None else min(walk.shared_length, limit)
        for node in reversed(walk.path[1:]):
            i = node.checkpoint_at_or_before(bound)
            if i >= 0:
                return node, node.ckpt_pos[i], node.ckpt_state[i]
        return walk.path[0], 0, None

    # structural edits ------------------------------------------------------------------------------------------

    def split(self, node: Node, position: int, now: int) -> Node:
        """Cut `node`'s edge at absolute `position` (start < position < end); returns the new upper node.

        The original object stays the lower part, so references held to it (locks, matches) remain the deeper
        node; the upper part inherits its locks (it is an ancestor of the same paths) and gets timestamp `now`."""
        self.version += 1
        at = position - node.start
        upper_kv, lower_kv = node.kv.split(at) if node.kv is not None else (None, None)
        upper = Node(self._new_id(), node.parent, node.tokens[:at], node.start, upper_kv, now, node.namespace)
        upper.lock_count, upper.branched = node.lock_count, True
        cut = bisect.bisect_right(node.ckpt_pos, position)
        upper.ckpt_pos, node.ckpt_pos = node.ckpt_pos[:cut], node.ckpt_pos[cut:]
        upper.ckpt_state, node.ckpt_state = node.ckpt_state[:cut], node.ckpt_state[cut:]
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens, node.start, node.kv, node.parent = node.tokens[at:], position, lower_kv, upper
        upper.children[int(node.tokens[0])] = node
        self.on_change(upper)
        self.on_change(node)
        return upper

    def add_leaf(
        self, parent: Node, tokens: np.ndarray, kv: KVPayload | None, now: int,
        checkpoints: list[tuple[int, Payload]] = (),
    ) -> Node:
        """A new child of `parent` holding `tokens` (which start at parent.end), their KV and `checkpoints`
        ((position, state) pairs on its edge)."""
        self.version += 1
        if parent.is_root and self.roots.setdefault(parent.namespace, parent) is not parent:
            raise AssertionError(f"{parent} is a stale root of namespace {parent.namespace!r}: walk again")
        leaf = Node(self._new_id(), parent, tokens, parent.end, kv, now, parent.namespace)
        if self._namespaces is not None:
            if not parent.is_root and not parent.children:
                self._namespaces.remove(parent.namespace, path_tokens(parent))
            self._namespaces.add(leaf.namespace, path_tokens(leaf))
        parent.children[int(tokens[0])] = leaf
        self.kv_bytes += leaf.kv_bytes
        self._store(leaf, checkpoints)
        self.on_change(leaf)
        self.on_change(parent)
        return leaf

    def add_checkpoints(self, node: Node, items: list[tuple[int, Payload]]) -> int:
        """Store (position, state) pairs on `node`'s edge, skipping positions that already hold one; returns how
        many were stored."""
        self.version += 1
        stored = self._store(node, items)
        self.on_change(node)
        return stored

    def drop_checkpoints(self, node: Node, first: int = 0, last: int | None = None) -> int:
        """Remove checkpoints ckpt_pos[first:last] of `node`; returns the bytes freed."""
        freed = self._drop(node, first, last)
        self.on_change(node)
        return freed

    def remove_leaf(self, node: Node) -> int:
        """Delete a childless node with its KV and checkpoints; returns the bytes freed."""
        self.version += 1
        freed = self._drop(node, 0, None) + node.kv_bytes
        self.kv_bytes -= node.kv_bytes
        parent = node.parent
        if self._namespaces is not None:
            self._namespaces.remove(node.namespace, path_tokens(node))
            if not parent.is_root and len(parent.children) == 1:
                self._namespaces.add(parent.namespace, path_tokens(parent))
        del parent.children[int(node.tokens[0])]
        if parent.is_root and not parent.children and self.roots.get(parent.namespace) is parent:
            del self.roots[parent.namespace]  # an empty namespace keeps no root (matches holding it still work)
        self.on_remove(node)
        self.on_change(parent)
        return freed

    def dissolve(self, node: Node) -> int:
        """Evict a single-child node: drop its checkpoints and merge its edge (KV kept) into the child; returns the
        bytes freed."""
        freed = self._drop(node, 0, None)
        self.merge_into_child(node)
        return freed

    def trim_tail(self, node: Node, position: int) -> int:
        """Cut a leaf's edge back to end at `position` (start < position < end); returns the bytes freed."""
        self.version += 1
        if self._namespaces is not None:
            self._namespaces.remove(node.namespace, path_tokens(node))
            self._namespaces.add(node.namespace, path_tokens(node)[:position])
        cut = bisect.bisect_right(node.ckpt_pos, position)
        freed = self._drop(node, cut, None)
        kept_kv, dropped_kv = node.kv.split(position - node.start) if node.kv is not None else (None, None)
        freed += dropped_kv.nbytes if dropped_kv is not None else 0
        self.kv_bytes -= dropped_kv.nbytes if dropped_kv is not None else 0
        node.tokens, node.kv = node.tokens[:position - node.start], kept_kv
        node.truncated, node.branched, node.resumed, node.recent_resumes = True, False, 0, 0.0
        self.on_change(node)
        return freed

    def merge_into_child(self, node: Node) -> Node:
        """Join a single-child `node` with its child (edge merge; its checkpoints move along); returns the child."""
        self.version += 1
        (child,) = node.children.values()
        kv = node.kv.concat(child.kv) if node.kv is not None and child.kv is not None else None
        child.tokens = np.concatenate([node.tokens, child.tokens])
        child.start, child.kv, child.parent = node.start, kv, node.parent
        child.ckpt_pos[:0], child.ckpt_state[:0] = node.ckpt_pos, node.ckpt_state
        child.last_access = max(child.last_access, node.last_access)
        node.parent.children[int(child.tokens[0])] = child
        self.on_remove(node)
        self.on_change(child)
        return child

    # Edits report each changed node once, after the whole edit (policies index nodes by their final shape).

    def _store(self, node: Node, items: list[tuple[int, Payload]]) -> int:
        stored = 0
        for position, state in items:
            i = bisect.bisect_left(node.ckpt_pos, position)
            if i < len(node.ckpt_pos) and node.ckpt_pos[i] == position:
                continue
            node.ckpt_pos.insert(i, position)
            node.ckpt_state.insert(i, state)
            self.state_bytes += state.nbytes
            stored += 1
        self.num_checkpoints += stored
        return stored

    def _drop(self, node: Node, first: int, last: int | None) -> int:
        last = len(node.ckpt_pos) if last is None else last
        freed = sum(s.nbytes for s in node.ckpt_state[first:last])
        self.num_checkpoints -= len(node.ckpt_pos[first:last])
        del node.ckpt_pos[first:last], node.ckpt_state[first:last]
        self.state_bytes -= freed
        return freed

    # locks -------------------------------------------------------------------------------------------------------

    def lock(self, node: Node, delta: int) -> None:
        """Add `delta` to the lock count of `node` and all its ancestors (locked nodes are never evicted)."""
        while node is not None:
            node.lock_count += delta
            node = node.parent

    # inspection --------------------------------------------------------------------------------------------------

    def nodes(self):
        """Every node (roots included), depth first."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recompute byte accounting and structure from scratch; AssertionError on any mismatch."""
        kv_bytes = state_bytes = checkpoints = 0
        for node in self.nodes():
            kv_bytes += node.kv_bytes
            state_bytes += node.state_bytes
            checkpoints += len(node.ckpt_pos)
            assert node.lock_count >= 0, f"{node} has a negative lock count"
            assert node.ckpt_pos == sorted(set(node.ckpt_pos)), f"{node} checkpoints not sorted and unique"
            assert all(node.start < p <= node.end for p in node.ckpt_pos), f"{node} checkpoint outside its edge"
            if node.kv is not None:
                assert node.kv.ntokens == len(node.tokens), f"{node} KV covers {node.kv.ntokens} tokens"
            for key, child in node.children.items():
                assert child.parent is node and child.start == node.end, f"{child} is not attached to {node}"
                assert len(child.tokens) > 0 and int(child.tokens[0]) == key, f"{child} has a wrong child key"
                assert child.lock_count <= node.lock_count, f"{child} is locked more than its parent"
        assert (kv_bytes, state_bytes, checkpoints) == (self.kv_bytes, self.state_bytes, self.num_checkpoints), (
            f"accounting drift: recomputed kv={kv_bytes} state={state_bytes} ckpts={checkpoints}, tracked "
            f"kv={self.kv_bytes} state={self.state_bytes} ckpts={self.num_checkpoints}"
        )


def path_tokens(node: Node) -> np.ndarray:
    """The tokens from the root of a radix-tree node's namespace to the end of its edge."""
    edges = [n.tokens for n in reversed(node.ancestors())]
    return np.concatenate(edges) if edges else np.zeros(0, dtype=np.int64)
