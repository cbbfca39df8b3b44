"""Admission and eviction policies: what each keeps, what each evicts, and Marconi's alpha tuning."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_helpers import (
    STATE_BYTES,
    PrefixState,
    TokenKV,
    naive_match,
    picks_under_a_live_match,
    request,
    tiny_spec,
    version_families,
)

from prefixlab.cache.alpha import ALPHA_GRID, AlphaBootstrap
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.policies import POLICY_NAMES, check_policy_name
from prefixlab.cache.replay import replay_request
from prefixlab.errors import InvalidInputError
from prefixlab.sim.replay import simulate
from prefixlab.sim.trace import Request

PROMPT = list(range(100, 110))


def _core(policy, capacity_bytes=100_000, **kw):
    return PrefixCacheCore(capacity_bytes, policy, tiny_spec(), block_size=4, **kw)


def _checkpoints(core):
    return sorted(p for node in core.tree.nodes() for p in node.ckpt_pos)


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(InvalidInputError) as err:
        check_policy_name("lru")
    assert all(name in str(err.value) for name in POLICY_NAMES)


@pytest.mark.parametrize(("policy", "second", "third"), [("marconi", 0, 10), ("sglang+", 0, 10), ("vllm+", 8, 8)])
def test_shared_input_prefix_reuse(policy, second, third):
    """Marconi's trade-off: a purely-input prefix gets its branch-point state on its second occurrence, so it is
    reused from the third; vLLM+ reuses whole blocks from the second."""
    core = _core(policy)
    assert request(core, PROMPT + [1, 2]).length == 0
    assert request(core, PROMPT + [3, 4]).length == second
    assert request(core, PROMPT + [5, 6]).length == third


def test_marconi_keeps_at_most_the_branch_point_and_the_last_token():
    core = _core("marconi")
    request(core, PROMPT + [1, 2], [7])
    request(core, PROMPT + [3, 4], [8])
    assert _checkpoints(core) == [10, 13, 13]


def test_vllm_states_every_block_and_supersedes_a_partial_last_block():
    core = _core("vllm+")
    request(core, [1, 2, 3, 4, 5, 6])
    assert _checkpoints(core) == [4, 6]
    request(core, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert _checkpoints(core) == [4, 8, 10]


def _offer(core, tokens, positions):
    """Admit `tokens` with exact payloads for the states at `positions` (no match: as load and offload do)."""
    kv = lambda a, b: TokenKV(tuple(tokens[a:b]))  # noqa: E731
    return core.admit(tokens, kv, {p: PrefixState(tuple(tokens[:p])) for p in positions})


def test_vllm_keeps_a_partial_block_state_when_the_extension_is_cut():
    # Room for one more state but not for the KV and state of the next block: the entry is cut to its state at 5,
    # so nothing fills the block past the old end state at 6, which stays (it went, and 5 with it, when the cut was
    # not looked at); 5 is superseded by 6, the deepest state of the block on its path.
    # (live requests resume from 4 and 6, so no state on the path may be thinned for the entry: it is cut)
    core = _core("vllm+", capacity_bytes=24 + 3 * STATE_BYTES + 50)
    request(core, [1, 2, 3, 4, 5, 6])
    live = [core.match([1, 2, 3, 4, 5, 99]), core.match([1, 2, 3, 4, 5, 6, 99])]
    assert _offer(core, list(range(1, 21)), [5, 8, 12, 16, 20])
    for match in live:
        core.release(match)
    assert _checkpoints(core) == [4, 6]
    assert naive_match(core, [1, 2, 3, 4, 5, 6, 99]) == (6, 6)
    core.check_invariants()


def test_vllm_supersedes_only_on_the_admitted_sequences_own_path():
    # [1, 9, ...] leaves [1, 2, 3, 4] after one token and is cut to its state at 1 ([1, 2, 3, 4] stays: a live
    # match holds it): the state at 4 on the same edge belongs to the other sequence and supersedes nothing of this one
    core = _core("vllm+", capacity_bytes=16 + 2 * STATE_BYTES + 50)
    request(core, [1, 2, 3, 4])
    held = core.match([1, 2, 3, 4])
    assert _offer(core, [1, 9, 9, 9, 9, 9], [1, 6])
    core.release(held)
    assert _checkpoints(core) == [1, 4] and naive_match(core, [1, 9])[0] == 1
    core.check_invariants()


def test_vllm_restore_keeps_a_partial_block_state_inside_a_longer_path():
    # [1..6] served after [1..8] keeps its end state at 6 inside the longer path; re-admitting that path as load and
    # the offload tier do (restore=True) must keep it, a new request through it would supersede it
    core = _core("vllm+")
    request(core, list(range(1, 9)))
    request(core, list(range(1, 7)))
    assert _checkpoints(core) == [4, 6, 8]
    path = list(range(1, 9))
    for restore, kept in ((True, [4, 6, 8]), (False, [4, 8])):
        fresh = _core("vllm+")
        fresh.admit(path, lambda a, b: TokenKV(tuple(path[a:b])), {p: PrefixState(tuple(path[:p])) for p in (4, 6, 8)},
                    restore=restore)
        assert _checkpoints(fresh) == kept


def test_vllm_does_not_supersede_a_state_a_live_match_holds():
    core = _core("vllm+")
    request(core, [1, 2, 3, 4, 5, 6])
    held = core.match([1, 2, 3, 4, 5, 6, 7])
    request(core, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # would supersede the state at 6, which `held` locks
    assert _checkpoints(core) == [4, 6, 8, 10] and naive_match(core, [1, 2, 3, 4, 5, 6, 99])[0] == 6
    core.check_invariants()
    core.release(held)


def test_sglang_evicts_the_least_recently_used_leaf():
    entry = 4 * 4 + STATE_BYTES
    core = _core("sglang+", capacity_bytes=2 * entry)
    request(core, [1, 1, 1, 1])
    request(core, [2, 2, 2, 2])
    request(core, [1, 1, 1, 1])  # refreshes the first entry
    request(core, [3, 3, 3, 3])
    assert [naive_match(core, [k] * 4)[0] for k in (1, 2, 3)] == [4, 0, 4]


def test_vllm_evicts_tail_blocks_first():
    core = _core("vllm+", capacity_bytes=3 * (STATE_BYTES + 16))
    request(core, [1] * 12)
    request(core, [2] * 4)  # needs one block: the tail block of the older entry goes
    assert naive_match(core, [1] * 12)[0] == 8 and naive_match(core, [2] * 4)[0] == 4


def test_marconi_refreshes_only_the_reused_node_on_a_hit():
    for policy, path_refreshed in (("marconi", False), ("sglang+", True)):
        core = _core(policy)
        for suffix in ([1, 2], [3, 4], [5, 6]):
            request(core, PROMPT + suffix)
        leaf = core.tree.walk(np.array(PROMPT + [1, 2]), "default").path[-1]
        before = leaf.last_access
        request(core, PROMPT + [1, 9])  # passes through the [1, 2] leaf's edge, reuses the branch point
        assert (leaf.last_access != before) == path_refreshed, policy


def test_flop_aware_eviction_of_a_single_child_node_merges_its_kv_into_the_child():
    core = _core("marconi", alpha=0.0)
    request(core, PROMPT + [1, 2])
    request(core, PROMPT + [3, 4])
    branch = core.tree.walk(np.array(PROMPT), "default").path[-1]
    core.tree.remove_leaf(branch.children[3])
    used = core.used_bytes
    freed = core.eviction.free(branch, 1)
    (merged,) = core.tree.roots["default"].children.values()
    assert freed == STATE_BYTES == used - core.used_bytes
    assert merged.kv.tokens == tuple(PROMPT + [1, 2]) and merged.ckpt_pos == [12]
    core.check_invariants()


def _reference_victim(eviction, now):
    """Marconi's utility by brute force: S = norm(1 / (now - ts)) + alpha * norm(flop_efficiency), argmin."""

    def normalised(values):
        low, high = min(values), max(values)
        return [1.0 if high == low else (v - low) / (high - low) for v in values]

    nodes = list(eviction.nodes.values())
    recency = normalised([1.0 / (now - n.last_access) for n in nodes])
    efficiency = normalised([eviction.flop_efficiency(n) for n in nodes])
    scores = {n.id: r + eviction.alpha * e for n, r, e in zip(nodes, recency, efficiency, strict=True)}
    unlocked = [scores[n.id] for n in nodes if n.lock_count == 0]  # locked nodes are scored but never picked
    return {i for i, s in scores.items() if np.isclose(s, min(unlocked), rtol=1e-12, atol=1e-12)}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    alpha=st.sampled_from(ALPHA_GRID),
    stream=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=2, max_size=25),
)
def test_flop_aware_pick_is_the_brute_force_argmin(alpha, stream):
    core = _core("marconi", alpha=alpha)
    for victim in picks_under_a_live_match(core, stream):
        if victim is not None:
            assert victim.lock_count == 0 and victim.id in _reference_victim(core.eviction, core.clock + 1)


def test_flop_efficiency_prices_with_the_cost_model_exactly():
    core = PrefixCacheCore(10**12, "marconi", ModelSpec.from_name("marconi-7b"), alpha=1.0)
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9], list(range(3000))):
        request(core, tokens)
    for node in core.eviction.nodes.values():
        end = node.ckpt_pos[-1] if node.ckpt_pos else node.end
        freed = node.state_bytes + (0 if node.children else node.kv_bytes)
        expected = core.spec.prefill_flops(end - node.start, node.start) / freed
        assert core.eviction.flop_efficiency(node) == expected  # bit for bit: the inlined formula is the model's


def test_large_alpha_evicts_the_least_flop_efficient_entry():
    results = {}
    for alpha in (0.0, 2.0):
        core = _core("marconi", capacity_bytes=3 * STATE_BYTES + 4 * 32 - 1, alpha=alpha)
        request(core, list(range(1000, 1028)))  # old, long: efficient
        request(core, [1, 2])  # recent, short: inefficient
        request(core, [3, 4])  # needs room
        results[alpha] = (naive_match(core, list(range(1000, 1028)))[0], naive_match(core, [1, 2])[0])
    assert results == {0.0: (0, 2), 2.0: (28, 0)}


def _conversations(sessions, turns, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(sessions):
        history = np.zeros(0, dtype=np.int64)
        for t in range(turns):
            inp = np.concatenate([history, rng.integers(0, 50, rng.integers(5, 40))])
            reply = rng.integers(0, 50, rng.integers(5, 40))
            out.append(Request(str(s), t, s + 3.0 * t, inp, reply))
            history = np.concatenate([inp, reply])
    return sorted(out, key=lambda r: r.ts)


def test_alpha_is_tuned_on_the_bootstrap_window_to_the_best_replay():
    requests, spec, capacity = _conversations(12, 4), tiny_spec(), 1500
    core = PrefixCacheCore(capacity, "marconi", spec, bootstrap_multiplier=2)
    first_eviction = None
    for i, r in enumerate(requests):
        replay_request(core, r.input_tokens, r.output_tokens)
        if first_eviction is None and core.evictions:
            first_eviction = i + 1
    assert first_eviction is not None and 2 * first_eviction <= len(requests)
    window = requests[: 2 * first_eviction]
    saved = {a: simulate(window, "marconi", capacity, spec, alpha=a, overflow=False).flops_saved for a in ALPHA_GRID}
    assert len(set(saved.values())) > 1  # the window does tell the alphas apart
    assert core.alpha == max(ALPHA_GRID, key=lambda a: (saved[a], -a))


@pytest.mark.parametrize("policy", ["marconi", "dp"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_window_replay_stands_for_every_alpha_that_evicts_alike(monkeypatch, policy, seed):
    tunings, real = [], AlphaBootstrap.window_flops_saved

    def spy(self, fresh, replay, grid=ALPHA_GRID):
        tunings.append((self.copy(), fresh.fork(), replay, grid))
        return real(self, fresh, replay, grid)

    monkeypatch.setattr(AlphaBootstrap, "window_flops_saved", spy)
    core = PrefixCacheCore(1500, policy, tiny_spec(), bootstrap_multiplier=3)
    for r in _conversations(12, 4, seed):
        replay_request(core, r.input_tokens, r.output_tokens)
    # marconi tunes once; dp provisionally (at 2 x N0, on its coarse grid) and then once more
    assert [grid for *_, grid in tunings] == ([ALPHA_GRID] if policy == "marconi" else
                                              [core.eviction.provisional_grid, ALPHA_GRID])
    for window, fresh, replay, grid in tunings:
        cores = set()
        def counted(core, tokens, n, cores=cores, replay=replay):
            return cores.add(id(core)) or replay(core, tokens, n)

        saved = real(window, fresh.fork(), counted, grid)
        # the reference: the warm stretch once, then one replay per alpha
        requests, start = list(window.requests), fresh.fork()
        warm = window.tune_at // window.multiplier - 1 - window.dropped
        warm_hits = [replay(start, tokens, n) for tokens, n in requests[:warm]]
        reference = {}
        for alpha in grid:
            each = start.fork()
            each.eviction.alpha = alpha
            hits = np.array(warm_hits + [replay(each, tokens, n) for tokens, n in requests[warm:]])
            reference[alpha] = float(np.sum(fresh.spec.flops_saved(hits)))
        assert saved == reference
        assert len(cores) - 1 < len(grid)  # the fresh core, then one per distinct sequence of evictions


@pytest.mark.parametrize("tied", [True, False])
def test_dp_skips_its_final_tuning_when_alpha_made_no_difference_to_the_provisional_one(monkeypatch, tied):
    grids, real = [], AlphaBootstrap.window_flops_saved

    def spy(self, fresh, replay, grid=ALPHA_GRID):
        grids.append(grid)
        saved = real(self, fresh, replay, grid)
        return dict.fromkeys(grid, 1.0) if tied else saved  # every alpha's replay saved the same FLOPs

    monkeypatch.setattr(AlphaBootstrap, "window_flops_saved", spy)
    core = PrefixCacheCore(1500, "dp", tiny_spec(), bootstrap_multiplier=3)
    for r in _conversations(12, 4):
        replay_request(core, r.input_tokens, r.output_tokens)
    coarse = core.eviction.provisional_grid
    assert core.bootstrap is None  # tuned for good either way
    if tied:  # the provisional alpha (the middle of the tie) stays
        assert grids == [coarse] and core.alpha == coarse[(len(coarse) - 1) // 2]
    else:
        assert grids == [coarse, ALPHA_GRID]


def test_dp_learns_where_requests_diverge_and_beats_marconi():
    stream = version_families(6)
    hits = {}
    for policy in ("marconi", "dp"):
        core = _core(policy, capacity_bytes=10**7, alpha=0.0)
        hits[policy] = [request(core, tokens).length for tokens in stream]
        core.check_invariants()
    assert hits["marconi"] == [0] * 12
    # dp's first entry holds the uniform prior's states (51, 102, 153, 204 of 256 tokens: free while nothing was
    # reused), so the second version resumes from 153; dp learns the 200-token divergence from that first family,
    # then checkpoints block 3 (192) of every entry
    assert hits["dp"][:2] == [0, 153] and hits["dp"][3::2] == [192] * 5


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("marconi+balanced", [20, 40, 60, 80, 100]), ("marconi+block", [64, 100]), ("marconi+log", [69, 90, 97, 99, 100])],
)
def test_heuristic_placements_plan_inside_the_computed_part(policy, expected):
    core = _core(policy)
    match = core.match(list(range(100)))
    assert core.plan(list(range(100)), match) == expected
    core.release(match)


def test_kv_only_vllm_evicts_and_cuts_whole_blocks():
    core = PrefixCacheCore(4 * 10, "vllm+", tiny_spec(hybrid=False), block_size=4)
    request(core, [1] * 6)
    request(core, [2] * 6)  # 24 + 24 bytes > 40: the older entry loses its last (partial) block
    assert naive_match(core, [1] * 6)[0] == 4 and naive_match(core, [2] * 6)[0] == 6
    request(core, [3] * 13)  # larger than the cache: everything else goes, then the longest whole-block prefix fits
    assert naive_match(core, [3] * 13)[0] == 8 and core.used_bytes == 32
    core.check_invariants()
