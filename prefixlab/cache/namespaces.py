"""Which namespaces hold a prefix: one radix trie over the leaf paths of every namespace of a tree, each trie node
counting the paths of each namespace through it, so the `other_namespace` reason (cache/explain.py) asks once
instead of walking every other namespace's tree (10,001 namespaces sharing a template: 49.6 ms a request). A
namespace holds the prefix tokens[:d] iff one of its leaf paths starts with it: iff the trie node where a walk of d
tokens ends counts that namespace. Built on first use (cache/tree.py `namespace_index`), then kept in step by the
tree's edits that change its leaves."""

from __future__ import annotations

from collections import Counter

import numpy as np


class _TrieNode:
    __slots__ = ("tokens", "children", "owners", "ends")

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.children: dict[int, _TrieNode] = {}
        self.owners: Counter = Counter()  # namespace -> its leaf paths through this node
        self.ends = 0  # paths ending here (a node no path ends at with one child is merged into it)


class NamespaceIndex:
    """The leaf paths of every namespace, counted per namespace; `add` / `remove` one path, `holds_other` asks."""

    def __init__(self) -> None:
        self.root = _TrieNode(np.zeros(0, dtype=np.int64))

    def add(self, namespace: str, path: np.ndarray) -> None:
        node, depth, total = self.root, 0, len(path)
        while depth < total:
            key = int(path[depth])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _TrieNode(np.array(path[depth:], dtype=np.int64))
            else:
                matched = _common(child.tokens, path[depth:])
                if matched < len(child.tokens):  # the path leaves (or ends) inside the edge: cut it there
                    upper = _TrieNode(child.tokens[:matched])
                    upper.owners = child.owners.copy()
                    child.tokens = child.tokens[matched:]
                    upper.children[int(child.tokens[0])] = child
                    child = node.children[key] = upper
            child.owners[namespace] += 1
            node, depth = child, depth + len(child.tokens)
        node.ends += 1

    def remove(self, namespace: str, path: np.ndarray) -> None:
        """Uncount a path `add` counted (AssertionError otherwise: the index no longer mirrors the tree)."""
        trail, node, depth = [], self.root, 0
        while depth < len(path):
            child = node.children.get(int(path[depth]))
            if child is None or child.owners[namespace] <= 0 or _common(child.tokens, path[depth:]) < len(child.tokens):
                raise AssertionError(f"namespace {namespace!r} has no counted path of {len(path)} tokens here")
            trail.append((node, child))
            node, depth = child, depth + len(child.tokens)
        node.ends -= 1
        for _, child in trail:
            child.owners[namespace] -= 1
            if not child.owners[namespace]:
                del child.owners[namespace]
        for parent, child in reversed(trail):  # deepest first: a merge leaves the pairs above it valid
            if not child.owners:  # no path through it any more (nor through its subtree)
                del parent.children[int(child.tokens[0])]
            elif not child.ends and len(child.children) == 1:  # no path ends here: one edge with its child
                (below,) = child.children.values()
                below.tokens = np.concatenate([child.tokens, below.tokens])
                parent.children[int(below.tokens[0])] = below

    def holds_other(self, namespace: str, tokens: np.ndarray, depth: int) -> bool:
        """Whether a namespace other than `namespace` holds the prefix tokens[:depth] (depth >= 1)."""
        node, done = self.root, 0
        while done < depth:
            child = node.children.get(int(tokens[done]))
            if child is None or _common(child.tokens, tokens[done:depth]) < min(len(child.tokens), depth - done):
                return False
            node, done = child, done + len(child.tokens)
        return len(node.owners) > (namespace in node.owners)


def _common(edge: np.ndarray, tokens: np.ndarray) -> int:
    """Length of the common prefix of `edge` and `tokens`."""
    n = min(len(edge), len(tokens))
    differs = edge[:n] != tokens[:n]
    return int(differs.argmax()) if differs.any() else n
