"""dp's eviction weighs an entry's leaf by how often leaves are resumed from (the law's leaf_weight, in its recency and
FLOP efficiency) and boosts the recency of a node resumed from again and again: against a brute-force argmin, and
what it keeps that leaf LRU and Marconi do not."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_helpers import dp_core, picks_under_a_live_match, request, tiny_spec

from prefixlab.cache.alpha import ALPHA_GRID
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.eviction import FlopAware, ThinningFlopAware
from prefixlab.cache.replay import replay_request
from prefixlab.cache.weighted_pick import FORGOTTEN_RESUMES
from prefixlab.sim.replay import simulate


def _stream(core, prompts):
    for prompt in prompts:
        replay_request(core, np.asarray(prompt), np.zeros(0, dtype=np.int64))


def test_leaves_never_resumed_from_weigh_less_in_eviction():
    rng = np.random.default_rng(0)
    shared = [list(rng.integers(0, 500, 60)) for _ in range(3)]  # three instructions, each + a unique query
    queries = [shared[i % 3] + list(rng.integers(1000, 5000, 40)) for i in range(60)]
    turns = [list(range(1, 30 + 20 * i)) for i in range(60)]  # a chat: every request continues the last one
    few_shot, chat = dp_core(capacity_bytes=6_000), dp_core(capacity_bytes=6_000)
    _stream(few_shot, queries)
    _stream(chat, turns)
    assert chat.admission.law.leaf_weight() == 1.0  # leaves are resumed from: Marconi's efficiency as it is
    weight = few_shot.admission.law.leaf_weight()
    assert 0 < weight < 0.75  # the queries' leaves are resumed from less often than the instructions' states
    eviction = few_shot.eviction
    eviction.pick(few_shot.clock + 1)  # the index is rebuilt with the law's current weight (as core calls it: later)
    leaves = [n for n in few_shot.tree.nodes() if n.id in eviction.nodes and few_shot.admission.shape_of(n) == 0
              and not eviction.thins(n)]  # whole-entry leaves (one with in-edge states is valued by them)
    assert leaves and eviction.leaf_weight == weight
    for leaf in leaves:
        assert eviction.efficiency[leaf.id] == pytest.approx(FlopAware.flop_efficiency(eviction, leaf) * weight)
        assert leaf.id in eviction.leaf_recency  # and its recency is weighed too
    few_shot.check_invariants()
    # a stint ends when the node leaves the tree or changes shape; nothing is left over once the tree is empty
    few_shot.capacity_bytes = 1
    few_shot._make_room(0, few_shot.tree.root("default"))
    assert not few_shot.admission._stint_shapes and not few_shot.admission._resumed
    assert not few_shot.admission._resumed_inside


def test_a_leaf_resumed_short_of_its_end_counts_as_a_resumed_prefix_not_a_resumed_leaf():
    # A prompt admitted in its first entry's leaf (as a re-admitted system prompt is, in a small cache): the next
    # request with the same prompt resumes from the in-edge state at the prompt's end. That reuses the prefix (the
    # request's split makes it a stored node), not the leaf's end, which is what leaf_weight prices.
    core = dp_core()
    law = core.admission.law
    prompt = list(range(1, 41))
    request(core, prompt + list(range(100, 160)))  # empty law: states at 20, 40, 60, 80 and the end (100)
    assert replay_request(core, np.asarray(prompt + list(range(200, 260))), np.zeros(0, dtype=np.int64)) == 40
    assert law.leaf_stints_resumed == 0 and law.stints_resumed == pytest.approx(law._scale)
    leaf_weight = law.leaf_weight()
    # a leaf continued from its end (a next turn) is a resumed leaf
    first = prompt + list(range(200, 260))
    assert replay_request(core, np.asarray(first + [7, 8, 9]), np.zeros(0, dtype=np.int64)) == len(first)
    assert law.leaf_stints_resumed > 0
    assert leaf_weight < 1.0  # the first entry's leaf was never resumed from its end (old code: 1, it was)
    core.check_invariants()


def _reference_weighted_victims(eviction, now):
    """dp's utility by brute force: Marconi's, an entry's leaf (no in-edge states) having recency weight / age and
    its efficiency times the weight, a node resumed from more than once lately its recency times 1 + ln(its decayed
    resumes), both terms min-max normalised over the candidates; the unlocked argmin set."""

    def normalised(values):
        low, high = min(values), max(values)
        return [1.0 if high == low else (v - low) / (high - low) for v in values]

    def boost(node):
        resumes = node.recent_resumes * eviction.admission.law.decay ** (now - node.resumed_at)
        return 1.0 + math.log(resumes) if resumes > 1.0 else 1.0

    nodes, weight = list(eviction.nodes.values()), eviction.leaf_weight
    weights = [weight if eviction.admission.shape_of(n) == 0 and not eviction.thins(n) else 1.0 for n in nodes]
    recency = normalised([w * boost(n) / (now - n.last_access) for n, w in zip(nodes, weights, strict=True)])
    # the efficiency each node was indexed with when it last changed (weighted leaves' times the weight): the law
    # moves between changes, so a value computed now can differ from the one the pick ranks by, by design
    efficiency = normalised([eviction.efficiency[n.id] for n in nodes])
    scores = {n.id: r + eviction.alpha * e for n, r, e in zip(nodes, recency, efficiency, strict=True)}
    unlocked = [scores[n.id] for n in nodes if n.lock_count == 0]
    return {i for i, s in scores.items() if np.isclose(s, min(unlocked), rtol=1e-12, atol=1e-12)}


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    alpha=st.sampled_from(ALPHA_GRID[::4]),
    weight=st.sampled_from([0.02, 0.3, 0.9]),
    stream=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=2, max_size=20),
)
def test_dp_pick_weighs_entry_leaves_recency_and_is_the_brute_force_argmin(alpha, weight, stream):
    core = PrefixCacheCore(10**7, "dp", tiny_spec(), block_size=4, alpha=alpha)
    core.admission.law.leaf_weight = lambda: weight  # as if the law had measured it
    for victim in picks_under_a_live_match(core, stream):
        if victim is not None:
            assert victim.lock_count == 0 and victim.id in _reference_weighted_victims(core.eviction, core.clock + 1)
    core.check_invariants()


@pytest.mark.parametrize("policy", ["marconi", "dp"])
def test_pick_at_the_newest_access_time_scores_every_age_as_at_least_one(policy):
    # a direct call with `now` equal to a candidate's last access (the core always picks after its clock moved) must
    # not divide by a zero age; it picks what the next tick would (old code: ZeroDivisionError in marconi's pick)
    core = PrefixCacheCore(10**7, policy, tiny_spec(), block_size=4, alpha=1.0)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 7, 7, 7]):
        request(core, tokens)
    newest = max(node.last_access for node in core.eviction.nodes.values())
    assert core.eviction.pick(newest) is core.eviction.pick(newest + 1) is not None


def test_a_weighted_leaf_goes_first_even_with_alpha_zero():
    # alpha 0 is plain LRU in Marconi; dp's leaf weight still applies to a leaf's recency, so a recent query leaf the
    # law says is rarely resumed goes before an older entry's in-edge states (old code: LRU's oldest candidate)
    core = dp_core()
    request(core, list(range(500, 540)))  # the oldest candidate: in-edge states (not weighted)
    prompt = list(range(1, 41))
    request(core, prompt + [100, 101])
    request(core, prompt + [200, 201])  # the prompt is stored now, with two query leaves
    core.admission.law.leaf_weight = lambda: 0.05
    victim = core.eviction.pick(core.clock + 1)
    assert core.admission.shape_of(victim) == 0 and victim.start == 40 and victim.tokens.tolist() == [100, 101]
    assert victim.id in _reference_weighted_victims(core.eviction, core.clock + 1)


def test_dp_keeps_few_shot_examples_where_leaf_lru_and_marconi_keep_queries():
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.sim.workloads import few_shot_trace

    requests, spec = few_shot_trace(), ModelSpec.from_name("marconi-7b")
    for capacity_bytes in (1_150_000_000, 2_300_000_000):  # the knee of this trace and twice it
        hits = {p: simulate(requests, p, capacity_bytes, spec).token_hit_rate for p in ("sglang+", "marconi", "dp")}
        assert hits["dp"] >= max(hits["sglang+"], hits["marconi"]) + 3.0, hits


PROMPT = list(range(1, 41))


def test_dp_pick_with_a_boost_is_the_brute_force_argmin_on_a_fixed_stream():
    core = dp_core(alpha=0.5)
    prompts = [[11] * 8 + [q % 4, q] for q in range(12)] + [[12] * 8 + [q] for q in range(6)]
    checked = 0
    for victim in picks_under_a_live_match(core, prompts):
        if victim is not None:
            assert victim.id in _reference_weighted_victims(core.eviction, core.clock + 1)
            checked += bool(core.eviction._boosts(core.clock + 1))
    assert checked >= 6  # picks that scored boosted candidates


def _serve_prompt_then_one_offs(policy, one_offs, questions=4):
    """A 40-token prompt asked `questions` questions, then `one_offs` entries of 40 tokens nobody repeats, in a cache
    of about four such entries (4 bytes of KV a token, 100 a state) at alpha 0 (LRU); the tokens of the prompt
    still reusable, and the core."""
    core = PrefixCacheCore(900, policy, tiny_spec(), block_size=4, alpha=0.0)
    request(core, PROMPT)
    for q in range(questions):
        request(core, PROMPT + [500 + q])
    for i in range(one_offs):
        request(core, list(range(1000 + 100 * i, 1040 + 100 * i)))
    held = core.match(PROMPT)
    core.release(held)
    return held.length, core


def test_a_prompt_resumed_from_again_and_again_outlives_a_burst_of_one_off_entries(monkeypatch):
    # LRU evicts the prompt, older than the one-offs, after its questions' leaves; dp keeps it for its resumes
    kept, core = _serve_prompt_then_one_offs("dp", one_offs=3)
    assert kept == len(PROMPT) and max(n.recent_resumes for n in core.tree.nodes()) > 2
    assert _serve_prompt_then_one_offs("marconi", one_offs=3)[0] == 0
    assert _serve_prompt_then_one_offs("dp", one_offs=8)[0] == 0  # for a while: the boost is on recency
    monkeypatch.setattr(ThinningFlopAware, "_boosts", lambda self, now: {})
    assert _serve_prompt_then_one_offs("dp", one_offs=3)[0] == 0  # what keeps it is the boost


def test_one_resume_is_no_evidence_and_old_resumes_are_forgotten():
    core = dp_core()
    for q in range(3):  # the second one splits at the prompt's end (a branch point); the third resumes from it
        request(core, PROMPT + [500 + q])
    (branch,) = [n for n in core.tree.nodes() if n.branched]
    assert branch.resumed == 1
    core.admission.law.leaf_weight = lambda: 1.0
    assert core.eviction._boosts(core.clock + 1) == {}  # (and not a candidate: three children)
    kept, core = _serve_prompt_then_one_offs("dp", one_offs=3)
    boosted = {i: core.eviction.nodes[i] for i in core.eviction.boosted}
    assert boosted and all(n.recent_resumes > 1.0 for n in boosted.values())
    now = core.clock + 1
    decay = core.admission.law.decay
    expected = {i: 1.0 + math.log(n.recent_resumes * decay ** (now - n.resumed_at)) for i, n in boosted.items()}
    factors = core.eviction._boosts(now)
    assert factors.keys() == {i for i, factor in expected.items() if factor > 1.0}
    assert all(math.isclose(factors[i], expected[i], rel_tol=1e-12) for i in factors)
    # long after: the decayed resumes fall below the threshold and are forgotten
    later = now + int(math.log(FORGOTTEN_RESUMES / 100) / math.log(decay))
    assert core.eviction._boosts(later) == {} and core.eviction.boosted == {}
    assert all(n.recent_resumes == 0.0 for n in boosted.values())


def test_a_pick_at_the_cores_clock_decays_boosts_to_the_now_it_ages_candidates_at():
    # the core picks at its clock, where the request's path was just refreshed: ages are taken from clock + 1 (>= 1),
    # and so must the boosts' decay be, or the score is no one moment's utility (old code: boosts decayed to clock,
    # recency aged at clock + 1; this stream's last pick was not the brute-force argmin at either)
    core = dp_core(alpha=0.5)
    core.admission.law.leaf_weight = lambda: 1.0
    stream = [[2, 2, 3, 1, 10], [18, 11, 22, 11, 6], [2, 2, 3, 1, 23], [2, 1, 2, 3, 1, 2, 36], [2, 2, 3, 1, 34],
              [2, 2, 3, 1, 28], [10, 33, 30, 11, 5], [2, 1, 2, 3, 1, 2, 39]]
    held, checked = None, 0
    for tokens in stream:
        request(core, tokens)
        if held is not None:
            core.release(held)
        held = core.match(tokens)
        victim = core.eviction.pick(core.clock)  # as _make_room calls it
        if victim is not None:
            assert victim.id in _reference_weighted_victims(core.eviction, core.clock + 1)
            checked += bool(core.eviction._boosts(core.clock + 1))
    core.release(held)
    assert checked
