"""Test helpers for the prefix cache: a tiny model spec, payloads that remember what they hold, and a naive
reference of what a match must return (computed by enumerating the tree, without the walk)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import LayerGroup, ModelSpec

STATE_BYTES, KV_BYTES_PER_TOKEN = 100, 4


def tiny_spec(hybrid: bool = True) -> ModelSpec:
    """One attention layer (4 bytes of KV per token) and, if hybrid, one recurrent layer (100-byte state)."""
    groups = [LayerGroup("attention", 1, 10.0, pair_flops=1.0, kv_bytes_per_token=KV_BYTES_PER_TOKEN)]
    if hybrid:
        groups.append(LayerGroup("mamba2", 1, 20.0, state_bytes=STATE_BYTES))
    return ModelSpec("tiny", 8, 2, tuple(groups))


@dataclass(frozen=True)
class TokenKV:
    """KV that carries the tokens it was computed for, so reuse can be checked token by token."""

    tokens: tuple[int, ...]

    @property
    def ntokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return KV_BYTES_PER_TOKEN * len(self.tokens)

    def split(self, at: int) -> tuple[TokenKV, TokenKV]:
        return TokenKV(self.tokens[:at]), TokenKV(self.tokens[at:])

    def concat(self, other: TokenKV) -> TokenKV:
        return TokenKV(self.tokens + other.tokens)


@dataclass(frozen=True)
class PrefixState:
    """A recurrent state standing for the exact prefix it summarises."""

    prefix: tuple[int, ...]
    nbytes: int = STATE_BYTES


def dp_core(capacity_bytes: int = 10**7, **options) -> PrefixCacheCore:
    """A dp core on the tiny hybrid spec, block 4, alpha 0 (options override)."""
    return PrefixCacheCore(capacity_bytes, "dp", tiny_spec(), block_size=4, **({"alpha": 0.0} | options))


def node_paths(core: PrefixCacheCore, namespace: str = "default"):
    """(node, full token tuple from the root to the node's end) for every non-root node, by plain recursion."""
    root = core.tree.roots.get(namespace)
    stack = [(child, ()) for child in root.children.values()] if root else []
    while stack:
        node, above = stack.pop()
        path = above + tuple(int(t) for t in node.tokens)
        yield node, path
        stack.extend((child, path) for child in node.children.values())


def naive_match(core: PrefixCacheCore, tokens, namespace: str = "default") -> tuple[int, int]:
    """(reusable length, shared length) by brute force: longest common prefix with any stored path, and the
    longest checkpointed prefix of `tokens` (every shared token for a KV-only model)."""
    tokens = tuple(int(t) for t in tokens)
    shared, checkpointed = 0, {()}
    for node, path in node_paths(core, namespace):
        common = 0
        while common < min(len(path), len(tokens)) and path[common] == tokens[common]:
            common += 1
        shared = max(shared, common)
        checkpointed.update(path[:p] for p in node.ckpt_pos)
    if not core.hybrid:
        return shared, shared
    return max(p for p in range(len(tokens) + 1) if tokens[:p] in checkpointed), shared


def request(core: PrefixCacheCore, inp, out=(), namespace: str = "default", release: bool = True):
    """Match, check what is returned against the tokens, admit input + output with exact payloads."""
    inp = np.asarray(inp, dtype=np.int64)
    tokens = np.concatenate([inp, np.asarray(out, dtype=np.int64)])
    match = core.match(inp, namespace)
    reused = tuple(int(t) for t in inp[: match.length])
    assert sum((kv.tokens for kv in match.kv), ()) == reused, "matched KV is not the KV of the reused tokens"
    if core.hybrid and match.length:
        assert match.state.prefix == reused, "matched state summarises another prefix"
    positions = core.plan(tokens, match)
    assert positions == sorted(set(positions)) and all(match.length < p <= len(tokens) for p in positions)
    states = {p: PrefixState(tuple(int(t) for t in tokens[:p])) for p in positions}
    core.admit(tokens, lambda a, b: TokenKV(tuple(int(t) for t in tokens[a:b])), states, match)
    if release:
        core.release(match)
    return match


def picks_under_a_live_match(core: PrefixCacheCore, stream):
    """Serve each request of `stream`, then hold a live match on it (its path is scored but must not be picked) and
    ask the eviction policy for a victim; yields each victim (or None). Releases the last match at the end."""
    held = None
    for tokens in stream:
        request(core, tokens)
        if held is not None:
            core.release(held)
        held = core.match(tokens)
        yield core.eviction.pick(core.clock + 1)
    if held is not None:
        core.release(held)


def snapshot(core: PrefixCacheCore) -> tuple:
    """Everything observable about the cache, to show a failed call changed nothing."""
    return core.stats(), sorted((path, tuple(node.ckpt_pos), node.lock_count) for node, path in node_paths(core))


def version_families(families: int, shared: int = 200, tail: int = 56, seed: int = 1) -> list[list[int]]:
    """Prompt families whose two versions share `shared` tokens and then diverge."""
    rng = np.random.default_rng(seed)
    stream = []
    for _ in range(families):
        common = list(rng.integers(1000, 2000, shared))
        stream += [common + list(rng.integers(2000, 3000, tail)), common + list(rng.integers(3000, 4000, tail))]
    return stream
