"""The brute-force reference for tests/test_core_model.py: payloads that carry their namespace and tokens, and
what a PrefixCacheCore's tree holds, found by plain enumeration (no walk)."""

from __future__ import annotations

from dataclasses import dataclass
from os.path import commonprefix

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import LayerGroup, ModelSpec

KV_BYTES_PER_TOKEN, STATE_BYTES, BLOCK = 4, 40, 4


def spec(hybrid: bool) -> ModelSpec:
    """One attention layer (4 bytes of KV per token) and, if hybrid, one recurrent layer (a 40-byte state, the KV of
    10 tokens: dp's placement then fires on entries of ~70 new tokens)."""
    groups = [LayerGroup("attention", 1, 10.0, pair_flops=1.0, kv_bytes_per_token=KV_BYTES_PER_TOKEN)]
    if hybrid:
        groups.append(LayerGroup("mamba2", 1, 20.0, state_bytes=STATE_BYTES))
    return ModelSpec("model-test", 8, 2, tuple(groups))


@dataclass(frozen=True)
class KV:
    """KV that knows the namespace and tokens it was computed for."""

    namespace: str
    tokens: bytes

    @property
    def ntokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return KV_BYTES_PER_TOKEN * len(self.tokens)

    def split(self, at: int) -> tuple[KV, KV]:
        return KV(self.namespace, self.tokens[:at]), KV(self.namespace, self.tokens[at:])

    def concat(self, other: KV) -> KV:
        assert other.namespace == self.namespace, "KV of two namespaces joined"
        return KV(self.namespace, self.tokens + other.tokens)


@dataclass(frozen=True)
class State:
    """A recurrent state standing for the exact prefix (and namespace) it summarises."""

    namespace: str
    prefix: bytes
    nbytes: int = STATE_BYTES


@dataclass
class Content:
    """What the tree holds, by enumeration: leaf paths per namespace, checkpointed prefixes, bytes."""

    leaves: dict[str, list[bytes]]
    checkpoints: set[tuple[str, bytes]]
    kv_tokens: int

    def shared(self, namespace: str, tokens: bytes) -> int:
        return max((len(commonprefix([leaf, tokens])) for leaf in self.leaves.get(namespace, ())), default=0)

    def reusable(self, namespace: str, tokens: bytes, hybrid: bool) -> int:
        if not hybrid:
            return self.shared(namespace, tokens)
        return max((len(p) for ns, p in self.checkpoints if ns == namespace and tokens.startswith(p)), default=0)

    def holds_path(self, namespace: str, tokens: bytes) -> bool:
        return not tokens or any(leaf.startswith(tokens) for leaf in self.leaves.get(namespace, ()))


def content(core: PrefixCacheCore, sized: bool) -> Content:
    """Enumerate the tree; check each payload matches the path it sits on (token payloads)."""
    leaves: dict[str, list[bytes]] = {}
    checkpoints, kv_tokens = set(), 0
    for namespace, root in core.tree.roots.items():
        stack = [(child, b"") for child in root.children.values()]
        while stack:
            node, above = stack.pop()
            assert node.namespace == namespace, f"{node} of namespace {node.namespace!r} under {namespace!r}"
            path = above + bytes(node.tokens.tolist())
            kv_tokens += len(node.tokens)
            assert node.kv is not None and node.kv.ntokens == len(node.tokens)
            if not sized:
                assert node.kv == KV(namespace, path[len(above):]), f"{node} holds KV of other tokens: {node.kv}"
            for position, state in zip(node.ckpt_pos, node.ckpt_state, strict=True):
                checkpoints.add((namespace, path[:position]))
                assert sized or state == State(namespace, path[:position]), f"{node} holds a foreign state {state}"
            if not node.children:
                leaves.setdefault(namespace, []).append(path)
                # a hybrid model's KV with no checkpoint at or after it can never be reused: such a leaf must go
                # (KV after a leaf's last checkpoint stays: evicting a child leaves its parent's tail, as Marconi)
                assert not core.hybrid or node.ckpt_pos or node.lock_count, f"{node}: a checkpoint-free leaf"
            stack.extend((child, path) for child in node.children.values())
    return Content({ns: sorted(paths) for ns, paths in leaves.items()}, checkpoints, kv_tokens)


def superseded(policy: str, namespace: str, tokens: bytes, after: Content) -> set[tuple[str, bytes]]:
    """What admitting `tokens` may drop without evicting: vllm+ supersedes a state inside a block once a deeper
    state of the sequence's held part (`after` holds its first `length` tokens) is held."""
    if policy != "vllm+":
        return set()
    length = after.shared(namespace, tokens)
    deepest = max((q for q in range(length + 1) if (namespace, tokens[:q]) in after.checkpoints), default=0)
    return {(namespace, tokens[:p]) for p in range(deepest) if p % BLOCK}


def trie_size(prefixes: set[tuple[str, bytes]]) -> int:
    """Tokens in the radix tree of these (namespace, prefix) paths: each shared token counted once."""
    total, previous = 0, (None, b"")
    for namespace, prefix in sorted(prefixes):
        common = len(commonprefix([prefix, previous[1]])) if namespace == previous[0] else 0
        total, previous = total + len(prefix) - common, (namespace, prefix)
    return total
