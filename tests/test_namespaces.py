"""The namespace index (cache/namespaces.py): under random request streams over several namespaces through every
policy (admissions, splits, evictions, trims, compactions), whether another namespace holds a prefix is what a
walk of every other namespace's tree says, whether the index was built before the stream or in the middle of it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_helpers import node_paths, request, tiny_spec

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.namespaces import NamespaceIndex

NAMESPACES = ("a", "b", "c")


def held_elsewhere(core, namespace, tokens, depth) -> bool:
    """By brute force: a namespace other than `namespace` has a stored path starting with tokens[:depth]."""
    prefix = tuple(int(t) for t in tokens[:depth])
    return any(path[:depth] == prefix for other in NAMESPACES if other != namespace
               for _, path in node_paths(core, other))


requests = st.lists(st.tuples(st.sampled_from(NAMESPACES),
                              st.lists(st.integers(1, 3), min_size=1, max_size=14),
                              st.lists(st.integers(1, 3), max_size=3)), min_size=1, max_size=25)


@pytest.mark.parametrize("policy", ["dp", "marconi", "vllm+", "sglang+"])
@given(stream=requests, capacity=st.sampled_from([250, 500, 1_000]), built_at=st.integers(0, 25),
       probes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=14), max_size=6))
@settings(max_examples=40, deadline=None)
def test_the_index_says_what_walking_every_namespace_says(policy, stream, capacity, built_at, probes):
    core = PrefixCacheCore(capacity, policy, tiny_spec(), block_size=4)  # (a few states: evictions and trims)
    for i, (namespace, prompt, output) in enumerate(stream):
        if i == built_at:
            core.tree.namespace_index()
        request(core, prompt, output, namespace=namespace)
    index = core.tree.namespace_index()
    for probe in [*probes, *(p for _, p, _ in stream)]:
        tokens = np.asarray(probe, dtype=np.int64)
        for namespace in NAMESPACES:
            for depth in range(1, len(tokens) + 1):
                assert index.holds_other(namespace, tokens, depth) == held_elsewhere(core, namespace, tokens, depth)


def test_paths_are_counted_and_merged_back_when_removed():
    index = NamespaceIndex()
    paths = [np.array(p, dtype=np.int64) for p in ([1, 2, 3, 4], [1, 2, 5], [1, 2])]
    for path in paths:
        index.add("a", path)
    index.add("b", paths[0])
    assert index.holds_other("a", paths[0], 4) and not index.holds_other("a", paths[1], 3)
    assert index.holds_other("b", paths[1], 3) and index.holds_other("b", paths[0], 4)
    for path in paths:
        index.remove("a", path)
    index.remove("b", paths[0])
    assert not index.root.children  # nothing left: no dead nodes kept
    with pytest.raises(AssertionError, match="no counted path"):
        index.remove("a", paths[2])
