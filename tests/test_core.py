"""PrefixCacheCore: the request protocol, byte budget, partial admission, namespaces and bad input."""

import numpy as np
import pytest
from prefix_helpers import (
    KV_BYTES_PER_TOKEN,
    STATE_BYTES,
    PrefixState,
    TokenKV,
    naive_match,
    request,
    snapshot,
    tiny_spec,
)

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.payload import SizedKV, SizedState
from prefixlab.errors import InvalidInputError


def _core(capacity_bytes=10_000, policy="marconi", hybrid=True, **kw):
    return PrefixCacheCore(capacity_bytes, policy, tiny_spec(hybrid), block_size=4, **kw)


def test_conversation_turn_reuses_the_previous_turn_exactly():
    core = _core()
    request(core, [1, 2, 3, 4], [5, 6])
    match = request(core, [1, 2, 3, 4, 5, 6, 7, 8], [9])
    assert (match.length, match.shared_length) == (6, 6)
    assert core.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).length == 9


def test_kv_only_model_reuses_every_shared_token():
    core = _core(hybrid=False)
    request(core, [1, 2, 3, 4, 5])
    match = request(core, [1, 2, 3, 9])
    assert (match.length, match.state) == (3, None)
    assert core.tree.state_bytes == 0
    assert core.plan([1, 2, 3, 9, 9], core.match([1, 2, 3, 9])) == []  # nothing recurrent to capture
    core.check_invariants()


def test_kv_only_model_keeps_no_states():
    # the HF path offers a (0-byte) snapshot of a KV-only model's empty recurrent states; kept, they would pin
    # nodes that should merge
    core = _core(hybrid=False)
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):
        core.admit(tokens, lambda a, b, t=tokens: TokenKV(tuple(t[a:b])), {3: PrefixState((1, 2, 3), nbytes=0)})
    assert core.tree.num_checkpoints == 0 and core.stats()["nodes"] == 2  # the root and one merged edge
    assert naive_match(core, [1, 2, 3, 4, 5, 9]) == (5, 5)
    core.check_invariants()


def test_hybrid_kv_alone_is_not_reusable():
    core = _core()
    request(core, [1, 2, 3, 4, 5])
    assert core.match([1, 2, 3, 9]).length == 0  # shared 3 tokens but no state there yet


def test_namespaces_do_not_share():
    core = _core()
    request(core, [1, 2, 3], namespace="a")
    assert request(core, [1, 2, 3], namespace="b").length == 0
    assert request(core, [1, 2, 3], namespace="a").length == 3


def test_plan_is_inside_the_unreused_part_and_admit_stores_the_planned_states():
    core = _core(policy="vllm+")
    match = core.match([1, 2, 3, 4, 5, 6])
    assert core.plan([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], match) == [4, 8, 10]
    core.release(match)


def test_entry_too_big_is_cut_to_the_prefix_that_fits():
    core = _core(capacity_bytes=2 * STATE_BYTES + 4 * 8, policy="vllm+")
    request(core, list(range(1, 13)))  # states at 4, 8, 12: only two fit with 8 tokens of KV
    assert core.used_bytes == 2 * STATE_BYTES + 4 * 8
    assert naive_match(core, list(range(1, 13))) == (8, 8)
    core.check_invariants()


def test_evicting_every_child_of_the_admitted_path_leaves_no_useless_kv():
    # [5, 6] holds no state, only the two branches below it; admitting [5, 9, 9] under pressure evicts both
    # branches while [5, 6] is protected as the admission's path, and its KV, reusable by nothing, must go too.
    core = _core(capacity_bytes=2 * STATE_BYTES + 17, policy="sglang+")  # both branches, not a third
    for tokens in ([5, 6, 1], [5, 6, 2], [5, 9, 9]):
        assert core.admit(tokens, lambda a, b, t=tokens: TokenKV(tuple(t[a:b])), {3: PrefixState(tuple(tokens))})
    assert [(n.start, n.end, n.ckpt_pos) for n in core.tree.nodes() if not n.is_root] == [(0, 3, [3])]
    assert core.used_bytes == 3 * KV_BYTES_PER_TOKEN + STATE_BYTES
    core.check_invariants()


@pytest.mark.parametrize(("policy", "capacity_states"), [("vllm+", 8), ("sglang+", 2), ("dp", 2)])
def test_an_entry_every_prompt_enters_a_little_is_evicted_below_the_shared_part(policy, capacity_states):
    """Every request shares 2 tokens (a chat template) with a cached entry that fills most of the budget. Only those
    2 are the new entry's path: the rest may go. The whole node was kept while evicting, so with a strict budget
    later admissions were cut or refused and the cache stayed stuck on the old entry (vllm+ on LMSys: 6.3 % at
    5 GB, 17.1 % with overflow)."""
    core = _core(capacity_bytes=capacity_states * STATE_BYTES + 40 * KV_BYTES_PER_TOKEN, policy=policy)
    big = [7, 8, *range(100, 124)]
    request(core, big)
    assert core.used_bytes > core.capacity_bytes // 2
    for first in (200, 300, 400):
        tokens = [7, 8, *range(first, first + 20)]
        assert not core.admit(tokens, lambda a, b, t=tokens: TokenKV(tuple(t[a:b])),
                              {len(tokens): PrefixState(tuple(tokens))}).refused
        assert request(core, tokens).length == len(tokens)  # held whole, reusable
        core.check_invariants()
    assert core.match(big).length < len(big)  # the old entry's tail made room


def test_overflow_keeps_the_whole_entry_until_the_next_admission():
    core = _core(capacity_bytes=2 * STATE_BYTES + 4 * 8, policy="vllm+", overflow=True)
    request(core, list(range(1, 13)))
    assert core.used_bytes > core.capacity_bytes and core.match(list(range(1, 13))).length == 12
    core.check_invariants()


def test_release_twice_and_foreign_matches_are_rejected():
    core, other = _core(), _core()
    match = core.match([1, 2])
    with pytest.raises(InvalidInputError, match="match"):
        other.release(match)
    core.release(match)
    with pytest.raises(InvalidInputError, match="match"):
        core.release(match)


def test_plan_needs_tokens_that_extend_the_match():
    core = _core()
    request(core, [1, 2, 3])
    match = core.match([1, 2, 3, 4])
    with pytest.raises(InvalidInputError, match="tokens"):
        core.plan([7, 8, 9, 10], match)
    core.release(match)


@pytest.mark.parametrize("hybrid", [True, False])
def test_peek_says_what_match_would_return_and_changes_nothing(hybrid):
    core = _core(hybrid=hybrid)
    request(core, [1, 2, 3, 4], [5, 6])
    request(core, [1, 2, 3, 9, 9])
    for tokens in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8], [1, 2], [7], []):
        before = snapshot(core)
        peeked = core.peek(tokens)
        assert snapshot(core) == before  # no request counted, nothing locked or refreshed
        match = core.match(tokens)
        assert peeked == (match.length, match.shared_length)
        core.release(match)
        for limit in range(len(tokens) + 1):  # one walk answers for a prefix of the tokens too
            assert core.peek(tokens, limit=limit) == (core.peek(tokens[:limit])[0], peeked[1])


BAD_TOKENS = [[1.5, 2.0], ["a", "b"], [[1, 2], [3, 4]], [[1], [2, 3]], "abc", [1, -2], [True, False], 7, [2**70]]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=repr)
def test_bad_tokens_raise_and_change_nothing(tokens):
    core = _core(capacity_bytes=500)
    request(core, [1, 2, 3, 4], [5])
    held = core.match([1, 2, 3, 4, 5])
    before = snapshot(core)
    with pytest.raises(InvalidInputError, match="tokens"):
        core.match(tokens)
    with pytest.raises(InvalidInputError, match="tokens"):
        core.peek(tokens)
    with pytest.raises(InvalidInputError, match="tokens"):
        core.plan(tokens, held)
    with pytest.raises(InvalidInputError, match="tokens"):
        core.admit(tokens, lambda a, b: TokenKV(()), {}, held)
    assert snapshot(core) == before
    core.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": -5}, "capacity_bytes"),
        ({"capacity_bytes": 1.5e9}, "capacity_bytes"),
        ({"policy": "lru"}, "vllm\\+, sglang\\+, marconi, dp"),
        ({"spec": "marconi-7b"}, "spec"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"checkpoint_budget": 4.0}, "checkpoint_budget"),
        ({"alpha": -1.0}, "alpha"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, names):
    args = {"capacity_bytes": 1000, "policy": "marconi", "spec": tiny_spec(), **kwargs}
    with pytest.raises(InvalidInputError, match=names):
        PrefixCacheCore(**args)


@pytest.mark.parametrize(
    ("kv", "states", "message"),
    [
        (lambda a, b: TokenKV(()), {3: PrefixState((1, 2, 3))}, "kv\\("),  # KV of the wrong length
        ("not callable", {}, "kv must be a callable"),
        (lambda a, b: TokenKV(()), {0: PrefixState(())}, "states key"),
        (lambda a, b: TokenKV(()), {9: PrefixState(())}, "states key"),
        (lambda a, b: TokenKV(()), {2.0: PrefixState(())}, "states key"),
        (lambda a, b: TokenKV(()), {2: object()}, "states\\[2\\]"),
    ],
)
def test_bad_admit_arguments_change_nothing(kv, states, message):
    core = _core(capacity_bytes=500)
    request(core, [7, 7, 7])
    before = snapshot(core)
    with pytest.raises(InvalidInputError, match=message):
        core.admit([1, 2, 3], kv, states)
    assert snapshot(core) == before
    core.check_invariants()


def test_bad_namespace():
    core = _core()
    with pytest.raises(InvalidInputError, match="namespace"):
        core.match([1], namespace="")
    match = core.match([1, 2], namespace="a")
    with pytest.raises(InvalidInputError, match="namespace"):
        core.admit([1, 2], lambda a, b: TokenKV((1, 2)[a:b]), {2: PrefixState((1, 2))}, match, namespace="b")


def test_marconi_7b_sizes_flow_through():
    spec = ModelSpec.from_name("marconi-7b")
    core = PrefixCacheCore(int(1e9), "sglang+", spec)
    tokens = np.arange(100)
    match = core.match(tokens)
    core.admit(tokens, lambda a, b: SizedKV(b - a, spec.kv_bytes_per_token), {100: SizedState(spec.state_bytes)}, match)
    core.release(match)
    assert core.used_bytes == 100 * spec.kv_bytes_per_token + spec.state_bytes
    assert core.match(tokens).length == 100



@pytest.mark.parametrize("policy", ["vllm+", "sglang+", "marconi", "dp"])
def test_fork_is_an_independent_copy_that_replays_like_a_deep_copy(policy):
    import copy

    from prefixlab.cache.replay import replay_request

    rng = np.random.default_rng(3)
    streams = [(rng.integers(0, 4, rng.integers(3, 25)), rng.integers(0, 4, 3)) for _ in range(60)]
    core = _core(3_000, policy, alpha=0.5)
    for inp, out in streams[:20]:
        replay_request(core, inp, out)
    fork, reference = core.fork(), copy.deepcopy(core)
    before = snapshot(core)
    hits = [[replay_request(c, inp, out) for inp, out in streams[20:]] for c in (fork, reference)]
    assert hits[0] == hits[1] and snapshot(fork) == snapshot(reference) and fork.evictions > core.evictions
    assert snapshot(core) == before  # the original is untouched
    fork.check_invariants()


def test_the_alpha_tuning_record_is_bounded_and_alpha_is_still_tuned():
    from prefixlab.cache.replay import replay_request

    rng = np.random.default_rng(5)
    core, held = _core(capacity_bytes=3_000, history_tokens=200), []
    for _ in range(300):
        replay_request(core, rng.integers(0, 50, 15), rng.integers(0, 50, 5))
        held.append(sum(len(tokens) for tokens, _ in core.bootstrap.requests) if core.bootstrap else 0)
    assert max(held) <= 200  # unbounded, it grows by 20 tokens a request until alpha is tuned
    assert core.evictions and core.bootstrap is None  # the window was replayed, alpha tuned
    lazy = _core(capacity_bytes=10**9, history_tokens=200)  # never evicts, so never tunes: the record stays bounded
    for _ in range(300):
        replay_request(lazy, rng.integers(0, 50, 15), rng.integers(0, 50, 5))
    assert lazy.bootstrap is not None and sum(len(tokens) for tokens, _ in lazy.bootstrap.requests) <= 200


def test_namespaces_that_hold_nothing_keep_no_root():
    from prefixlab.cache.replay import replay_request

    core = _core(capacity_bytes=2 * STATE_BYTES + 64)
    for i in range(100):  # looked up only
        core.release(core.match([1, 2, 3], namespace=f"tenant-{i}"))
    assert core.tree.roots == {}
    for i in range(100):  # each admission evicts the older tenants' entries
        replay_request(core, [1, 2, 3, 4, 5], [6], namespace=f"tenant-{i}")
    assert len(core.tree.roots) <= 2 and core.stats()["nodes"] <= 6
    core.check_invariants()
    assert core.match([1, 2, 3, 4, 5, 6], namespace="tenant-99").length > 0


def test_constructor_takes_numpy_integers_as_ints():
    """Sizes computed with numpy (np.int64) configure the cache exactly as Python ints do."""
    import numpy as np

    by_int = PrefixCacheCore(1000, "marconi", tiny_spec(), block_size=4, checkpoint_budget=2, history_tokens=64)
    by_numpy = PrefixCacheCore(np.int64(1000), "marconi", tiny_spec(), block_size=np.int64(4),
                               checkpoint_budget=np.int32(2), history_tokens=np.int64(64))
    assert by_numpy.options == by_int.options and type(by_numpy.options.block_size) is int


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -0.5, True, "1"])
def test_an_alpha_that_is_not_a_finite_number_is_refused(alpha):
    """NaN made every eviction score NaN: the cache never evicted and refused every admission past its budget."""
    with pytest.raises(InvalidInputError, match="finite number"):
        _core(alpha=alpha)
    assert _core(alpha=np.float32(0.5)).alpha == 0.5  # (a number computed with numpy)


def test_peek_limit_must_be_a_count_of_tokens():
    core = _core(hybrid=False)
    request(core, [1, 2, 3, 4, 5])
    assert core.peek([1, 2, 3, 4, 5], limit=np.int64(2)) == (2, 5)
    for limit in (-3, 2.5, True, "3"):  # -3 came back as a reusable length of -3
        with pytest.raises(InvalidInputError, match="limit"):
            core.peek([1, 2, 3, 4, 5], limit=limit)


def test_numpy_state_positions_are_stored_as_ints():
    """np.uint64(8) was kept in the tree: match().length - 9 wrapped to 2**64 - 1 and PrefixStore.save failed."""
    core = _core(capacity_bytes=1 << 30)
    core.admit(np.arange(1, 9), lambda a, b: SizedKV(b - a, 4), {np.uint64(8): SizedState(40)})
    match = core.match(np.arange(1, 9))
    assert type(match.length) is int and match.length - 9 == -1
    core.release(match)
    assert all(type(p) is int for node in core.tree.nodes() for p in node.ckpt_pos)


def test_token_ids_beyond_int64_are_refused_not_wrapped():
    core = _core()
    before = snapshot(core)
    for tokens in (np.array([1, 2**63], dtype=np.uint64), [2**64 - 1]):  # read as negative ids before
        with pytest.raises(InvalidInputError, match="2\\*\\*63"):
            core.match(tokens)
    assert snapshot(core) == before


def test_fork_with_a_live_match_is_refused():
    core = _core()
    request(core, [1, 2, 3, 4])
    match = core.match([1, 2, 3, 4])
    with pytest.raises(InvalidInputError, match="release them first"):
        core.fork()
    core.release(match)
    assert core.fork().match([1, 2, 3, 4]).length == 4
