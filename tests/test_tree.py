"""Radix tree: structure edits keep bytes exact; random request streams through every policy keep the tree
consistent, match what a brute-force reference says, and never lose locked entries."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_helpers import PrefixState, TokenKV, naive_match, node_paths, request, tiny_spec

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.policies import POLICY_NAMES
from prefixlab.cache.tree import RadixTree


def _tree_with(*sequences):
    tree = RadixTree()
    for seq in sequences:
        seq = np.asarray(seq, dtype=np.int64)
        walk = tree.walk(seq, "ns")
        parent = tree.split(walk.path[-1], walk.shared_length, 0) if walk.ends_inside_edge else walk.path[-1]
        if walk.shared_length < len(seq):
            tree.add_leaf(parent, seq[walk.shared_length:], TokenKV(tuple(seq[walk.shared_length:])), 0)
    return tree


def test_walk_reports_the_first_mismatch_inside_an_edge():
    tree = _tree_with([1, 2, 3, 4, 5])
    walk = tree.walk(np.array([1, 2, 3, 9]), "ns")
    assert walk.shared_length == 3 and walk.ends_inside_edge
    assert tree.walk(np.array([7]), "ns").shared_length == 0
    assert tree.walk(np.array([1, 2]), "other").shared_length == 0  # namespaces have separate roots


def test_walk_compares_ids_not_bytes_and_resumes_a_prefix_walk():
    tree = _tree_with([1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9], [1, 2, 3, 7, 8, 9, 10, 11])
    assert tree.walk(np.array([1, 2, 3, 4, 5, 6], dtype=np.int32), "ns").shared_length == 5
    for tokens in ([1, 2, 3, 7, 8, 9, 10, 11, 12], [1, 2, 3, 7, 8, 9, 10, 99], [1, 2, 3, 4, 0], [1, 2, 9, 9], [5]):
        tokens = np.array(tokens)
        fresh = tree.walk(tokens, "ns")
        for cut in range(len(tokens) + 1):
            resumed = tree.walk(tokens, "ns", resume=tree.walk(tokens[:cut], "ns"))
            assert (resumed.path, resumed.shared_length) == (fresh.path, fresh.shared_length)
            assert resumed.walked == fresh.walked == len(tokens)


def test_split_and_merge_keep_kv_tokens_and_bytes():
    tree = _tree_with([1, 2, 3, 4, 5], [1, 2, 3, 7])
    (top,) = tree.roots["ns"].children.values()
    assert top.kv.tokens == (1, 2, 3) and sorted(len(c.tokens) for c in top.children.values()) == [1, 2]
    assert tree.kv_bytes == 4 * 6
    tree.remove_leaf(top.children[7])
    merged = tree.merge_into_child(top)
    assert merged.kv.tokens == (1, 2, 3, 4, 5) and merged.start == 0
    tree.check_invariants()
    assert tree.kv_bytes == 4 * 5


def test_trim_tail_drops_checkpoints_past_the_cut():
    tree = _tree_with([1, 2, 3, 4, 5, 6])
    (leaf,) = tree.roots["ns"].children.values()
    tree.add_checkpoints(leaf, [(2, PrefixState((1, 2))), (6, PrefixState((1, 2, 3, 4, 5, 6)))])
    freed = tree.trim_tail(leaf, 2)
    assert freed == 100 + 4 * 4 and leaf.ckpt_pos == [2] and leaf.kv.tokens == (1, 2)
    tree.check_invariants()


def test_checkpoints_anywhere_on_an_edge_are_found_by_depth():
    tree = _tree_with([5, 6, 7, 8, 9])
    (leaf,) = tree.roots["ns"].children.values()
    tree.add_checkpoints(leaf, [(2, PrefixState((5, 6))), (4, PrefixState((5, 6, 7, 8)))])
    node, position, state = tree.deepest_checkpoint(tree.walk(np.array([5, 6, 7, 1]), "ns"))
    assert (node, position, state.prefix) == (leaf, 2, (5, 6))


def test_locks_cover_the_path_and_are_inherited_by_a_split():
    tree = _tree_with([1, 2, 3, 4])
    (leaf,) = tree.roots["ns"].children.values()
    tree.lock(leaf, +1)
    upper = tree.split(leaf, 2, 0)
    assert upper.lock_count == leaf.lock_count == 1
    tree.lock(leaf, -1)
    assert upper.lock_count == leaf.lock_count == tree.roots["ns"].lock_count == 0


token_seqs = st.lists(st.integers(0, 3), min_size=0, max_size=24)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    policy=st.sampled_from(POLICY_NAMES),
    hybrid=st.booleans(),
    capacity_bytes=st.integers(150, 2500),
    stream=st.lists(st.tuples(token_seqs, token_seqs, st.booleans()), max_size=20),
)
def test_random_requests_keep_the_tree_exact(policy, hybrid, capacity_bytes, stream):
    core = PrefixCacheCore(capacity_bytes, policy, tiny_spec(hybrid), block_size=4, bootstrap_multiplier=1)
    held = []
    for inp, out, hold in stream:
        expected = naive_match(core, inp)
        match = request(core, inp, out, release=not hold)
        assert (match.length, match.shared_length) == expected
        assert match.length <= match.shared_length <= len(inp)
        if hold:
            held.append((match, tuple(inp[: match.length])))
        elif held and len(held) % 2:
            core.release(held.pop(0)[0])
        core.check_invariants()
        stored = {path[:p] for node, path in node_paths(core) for p in node.ckpt_pos}
        for _, prefix in held:  # what a live match returned is still there
            assert not core.hybrid or not prefix or prefix in stored
            assert naive_match(core, prefix)[1] == len(prefix)
    for match, _ in held:
        core.release(match)
    core.check_invariants()
    assert core.stats()["locked_matches"] == 0


@pytest.mark.parametrize("policy", ["sglang+", "marconi"])
def test_a_locked_entry_survives_pressure_from_other_requests(policy):
    core = PrefixCacheCore(600, policy, tiny_spec(), alpha=0.5)
    request(core, [1] * 20)
    kept = core.match([1] * 20)
    for k in range(2, 30):
        request(core, [k] * 20)
        core.check_invariants()
    assert kept.length == 20 and naive_match(core, [1] * 20) == (20, 20)
    core.release(kept)
    request(core, [30] * 20)
    request(core, [31] * 20)
    assert naive_match(core, [1] * 20) == (0, 0)  # unlocked, it is the least recent and goes


def test_a_namespace_root_exists_only_while_it_holds_entries():
    tree = RadixTree()
    assert tree.walk(np.array([1, 2]), "ghost").path[0].is_root and tree.roots == {}  # a lookup creates nothing
    tree = _tree_with([1, 2, 3])
    (leaf,) = tree.roots["ns"].children.values()
    tree.remove_leaf(leaf)
    assert tree.roots == {} and list(tree.nodes()) == []
    tree.check_invariants()


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(-5, 5)), max_size=60),
       st.dictionaries(st.integers(0, 30), st.integers(-5, 5), max_size=30))
def test_sorted_index_put_many_orders_as_puts_do(puts, many):
    """dp re-indexes every weighted leaf when the leaf weight moves: one sort (put_many), not a put each (O(n^2) at
    60k candidates: 1.4 s per such request)."""
    from prefixlab.cache.sorted_index import SortedIndex

    one_by_one, bulk = SortedIndex(), SortedIndex()
    for node_id, key in puts:
        one_by_one.put(node_id, (key,))
        bulk.put(node_id, (key,))
    for node_id, key in many.items():
        one_by_one.put(node_id, (key,))
    bulk.put_many({node_id: (key,) for node_id, key in many.items()})
    assert list(bulk) == list(one_by_one) and set(bulk.ids()) == set(one_by_one.ids())
