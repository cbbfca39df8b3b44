"""dp's priced placement (prefixlab.cache.priced) and its thinning eviction: the law, the prices, bad input."""

import math

import numpy as np
import pytest
from prefix_helpers import STATE_BYTES, dp_core, request, tiny_spec, version_families

from prefixlab.cache.alpha import tune_alpha
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.eviction import FlopAware, ThinningFlopAware
from prefixlab.cache.law import EntryLaw
from prefixlab.cache.priced import PricedAdmission
from prefixlab.cache.replay import replay_request
from prefixlab.sim.replay import simulate
from prefixlab.sim.trace import Request


def _law_arrays(law: EntryLaw):
    return law._interior / law._scale, law.entries / law._scale


def test_empty_law_prices_nothing_and_is_finite():
    law = EntryLaw(max_len=256, block=16, decay=0.9, resolve_every=5)
    assert law.pressure == 0.0 and law.repeat_rate == 0.0 and law.calibration(100.0) == 1.0
    assert law.table() is None and law.best_from_end(200) == (16, 0.0)
    assert law.interior_mass(0, 10) == 0.0
    law.tick()
    law.add_interior(10_000)  # beyond max_len: counted in the last bin, not dropped
    assert law.table() is None  # no entry admitted yet: nothing per entry
    law.add("entries")
    law.tick()
    table = law.table()
    assert table is not None and all(math.isfinite(c) for c in table.curve(4))


def test_law_decays_per_request_and_survives_many_requests():
    law = EntryLaw(max_len=64, block=16, decay=0.5, resolve_every=5)
    law.tick()
    law.add_interior(20)
    law.tick()
    interior, _ = _law_arrays(law)
    assert interior[1] == pytest.approx(0.5)
    for _ in range(2000):  # the scale renormalises instead of overflowing
        law.tick()
    interior, _ = _law_arrays(law)
    assert np.isfinite(interior).all() and law.requests / law._scale == pytest.approx(2.0, rel=1e-6)


def test_the_law_counts_overlaps_whether_or_not_a_state_caught_them():
    core = dp_core()
    hits = [request(core, tokens).length for tokens in version_families(8)]
    assert hits[-1] > 0  # a placed state caught the last family's divergence ...
    interior, _ = _law_arrays(core.admission.laws["branch"])
    # ... and every second version still counted as an overlap at depth 200 (block 12 of 16 tokens)
    assert interior[12] == pytest.approx(sum(0.99 ** age for age in range(0, 16, 2)), rel=1e-9)
    core.check_invariants()


def test_placement_is_free_while_stored_tokens_go_unused_and_priced_once_they_pay():
    admission = PricedAdmission(block=16, decay=0.99, resolve_every=1, state_tokens=10_000.0)  # a costly state
    core = dp_core()
    core.admission = admission  # a fresh admission on a fresh core: plan through the core's tree
    for tokens in version_families(6):
        request(core, tokens)
    law = admission.laws["branch"]
    assert law.table() is not None
    walk = core.tree.walk(np.arange(5000, 5256), "default")
    law_all = admission.law
    law_all.reused = 0.0  # no stored token was ever reused: bytes buy nothing else, the learnt depth is placed
    assert [p for p in admission.plan(walk, 256, 0) if p != 256]
    law_all.reused, law_all.computed = 1.0e6 * law_all._scale, 0.0  # every token stored is reused: dear bytes
    assert admission.plan(walk, 256, 0) == [256]  # only the last token: no placed state pays for its bytes


def test_prompt_repeats_get_a_state_at_the_input_end():
    rng = np.random.default_rng(0)
    prompt, answer = rng.integers(0, 500, 90), rng.integers(500, 1000, 40)
    hits = {}
    for policy in ("marconi", "dp"):  # the same question and answer again: nothing branches, the input is shared
        core = PrefixCacheCore(10**7, policy, tiny_spec(), block_size=4, alpha=0.0)
        hits[policy] = [replay_request(core, prompt, answer) for _ in range(4)]
    # dp: the first entry gets the uniform prior's 4 states (26, 52, 78, 104 of 130 tokens: nothing was reused
    # yet, so they cost nothing), the second request resumes from 78, then the repeat law puts a state at 90
    assert hits == {"marconi": [0, 0, 0, 0], "dp": [0, 78, 90, 90]}


def test_thinning_drops_placed_states_before_whole_entries():
    spec = tiny_spec()
    core = dp_core(capacity_bytes=10**6)
    assert isinstance(core.eviction, ThinningFlopAware)
    for tokens in version_families(6):
        request(core, tokens)
    node = next(n for n in core.tree.nodes() if n.ckpt_pos and n.ckpt_pos[0] < n.end)
    before = len(node.ckpt_pos)
    nodes_before = sum(1 for _ in core.tree.nodes())
    freed = core.eviction.free(node, 1)  # one byte wanted: one state goes, the entry stays
    assert freed == STATE_BYTES and len(node.ckpt_pos) == before - 1
    assert sum(1 for _ in core.tree.nodes()) == nodes_before
    assert math.isfinite(core.eviction.flop_efficiency(node)) and spec.state_bytes == STATE_BYTES
    core.check_invariants()


@pytest.mark.parametrize(
    "requests",
    [
        [Request("a", 0, 0.0, np.arange(50))],  # one request
        [Request(str(i), 0, float(i), np.arange(50), np.arange(7)) for i in range(12)],  # identical prompts
        [Request(str(i), 0, float(i), np.arange(i, i + 40)) for i in range(12)],  # empty outputs
        [Request(str(i), 0, float(i), np.array([i % 3]), np.array([1])) for i in range(12)],  # one-token prompts
    ],
    ids=["one-request", "identical-prompts", "empty-outputs", "one-token-prompts"],
)
@pytest.mark.parametrize("capacity_bytes", [STATE_BYTES // 2, 10**6], ids=["below-one-state", "roomy"])
def test_degenerate_traces_run_and_report_sensibly(requests, capacity_bytes):
    for overflow in (True, False):
        result = simulate(requests, "dp", capacity_bytes, tiny_spec(), overflow=overflow)
        values = (result.token_hit_rate, result.request_hit_rate, result.flops_saved, result.ttft_p50_s)
        assert all(math.isfinite(v) for v in values) and 0 <= result.token_hit_rate <= 100


def test_degenerate_traces_leave_finite_laws():
    core = PrefixCacheCore(STATE_BYTES // 2, "dp", tiny_spec(), block_size=4)
    for i in range(20):
        replay_request(core, np.array([7]), np.zeros(0, dtype=np.int64) if i % 2 else np.array([i]))
    law = core.admission.law
    assert all(math.isfinite(x) for x in (law.pressure, law.repeat_rate, law.calibration(1.0)))
    core.check_invariants()


def test_dp_on_a_kv_only_model_is_marconi():
    spec = tiny_spec(hybrid=False)
    requests = [Request(str(i), 0, float(i), np.arange(i % 4, 60 + i % 4)) for i in range(10)]
    dp, marconi = (simulate(requests, p, 400, spec, alpha=0.5) for p in ("dp", "marconi"))
    assert dp.token_hit_rate == marconi.token_hit_rate


def test_only_whole_entry_evictions_start_the_alpha_bootstrap():
    core = PrefixCacheCore(10**6, "dp", tiny_spec(), block_size=4)  # alpha tuned: a bootstrap window
    for tokens in version_families(6):
        request(core, tokens)
    thin = next(n for n in core.tree.nodes() if n.ckpt_pos and n.ckpt_pos[0] < n.end)
    whole = next(n for n in core.tree.nodes() if not n.children and not core.eviction.thins(n))
    root = core.tree.root("default")
    core.capacity_bytes = core.used_bytes
    core.eviction.pick = lambda now: thin
    assert core._make_room(1, root) and core.bootstrap.tune_at is None  # a thinning move: not an eviction
    core.capacity_bytes = core.used_bytes
    core.eviction.pick = lambda now: whole
    assert core._make_room(1, root) and core.bootstrap.tune_at == 5 * core.requests  # Marconi's 5 x N0


def test_alpha_replays_start_from_the_live_law():
    live = dp_core()
    for tokens in version_families(6):
        request(live, tokens)
    fresh = dp_core()
    fresh.admission.seed(live.admission)
    for kind, law in live.admission.laws.items():
        np.testing.assert_array_equal(_law_arrays(fresh.admission.laws[kind])[0], _law_arrays(law)[0])
    fresh.admission.laws["branch"].add_interior(3)  # a copy: the replays leave the live law alone
    assert not np.array_equal(fresh.admission.laws["branch"]._interior, live.admission.laws["branch"]._interior)


def test_the_uniform_prior_is_placed_only_while_states_cost_nothing():
    core = dp_core()
    first = list(range(1, 101))
    match = core.match(first)
    assert core.plan(first, match) == [20, 40, 60, 80, 100]  # empty cache, empty law: 4 evenly spaced + the end
    core.release(match)
    request(core, first)
    request(core, first[:50] + list(range(500, 550)))  # a reuse: stored tokens now earn something
    later = list(range(1000, 1100))
    match = core.match(later)
    assert 20 not in core.plan(later, match)
    core.release(match)


@pytest.mark.parametrize("overflow", [False, True])
def test_dp_adds_no_state_that_makes_an_entry_outgrow_a_strict_budget(overflow):
    """A 100-token entry (400 bytes of KV) and its end state fit a 600-byte budget; with the prior's 4 states
    (900 bytes) it does not, and a strict budget cut it at one of them: a long document lost its end (document QA
    in a store that holds the document: dp 79 % against marconi's 98 %). An entry too big either way keeps them:
    they are where it can be cut. With overflow (the simulator's default) an entry is kept whole: states cut
    nothing."""
    entry, prior = list(range(1, 101)), [20, 40, 60, 80, 100]
    for capacity_bytes, planned, reused in ((600, prior if overflow else [100], 100), (300, prior, 20)):
        core = PrefixCacheCore(capacity_bytes, "dp", tiny_spec(), block_size=4, overflow=overflow)
        match = core.match(entry)
        assert core.plan(entry, match) == planned
        core.release(match)
        request(core, entry)
        assert core.match(entry).length == (100 if overflow else reused)
        core.check_invariants()


def test_dp_tuner_keeps_the_middle_of_tied_alphas():
    flat = {0.0: 1.0, 0.1: 2.0}
    assert tune_alpha(lambda a: flat.get(a, 3.0)) == 0.2  # Marconi: the smallest of the best
    assert tune_alpha(lambda a: flat.get(a, 3.0), ties="middle") == 1.1  # dp: the middle of 0.2 .. 2.0
    assert ThinningFlopAware.alpha_ties == "middle" and FlopAware.alpha_ties == "smallest"


def test_replay_caches_change_no_decision(monkeypatch):
    """Solved tables reused by histogram, thinning's read-back of the values its drop computed and the law's
    sums of bin ranges are only caches: a replay without them makes the same decisions (hits, evictions, tree)."""
    from prefixlab.cache import law
    from prefixlab.cache.placement import PlacementTable

    rng = np.random.default_rng(3)
    shared = [list(rng.integers(0, 500, 60)) for _ in range(4)]
    prompts = [shared[i % 4] + list(rng.integers(1000, 5000, int(rng.integers(5, 60)))) for i in range(120)]

    def replay():
        core, drops = dp_core(capacity_bytes=3_000), []

        def drop(node, *span, original=core.tree.drop_checkpoints):
            freed = original(node, *span)
            last = core.eviction._last_values
            if last is not None and last[0] is node:  # what free reads back is what it would recompute
                assert last[1] == core.eviction._interior_values(node)
                drops.append(node.id)
            return freed

        monkeypatch.setattr(core.tree, "drop_checkpoints", drop)
        hits = [replay_request(core, np.asarray(p), np.zeros(0, dtype=np.int64)) for p in prompts]
        return hits, core.evictions, sorted((n.start, n.end, tuple(n.ckpt_pos)) for n in core.tree.nodes()), drops

    def exact_mass(self, first, last):  # the histogram summed at every call
        return float(self._interior[first:max(first, last)].sum() / self.entries) if self.entries > 0 else 0.0

    reused_sums, summed = [], EntryLaw.interior_mass

    def checked_mass(self, first, last):
        reused_sums.append((first, last) in self._sums)
        mass = summed(self, first, last)
        assert mass == exact_mass(self, first, last), "a reused sum is stale"
        return mass

    monkeypatch.setattr(EntryLaw, "interior_mass", checked_mass)
    cached = replay()
    solved = []
    monkeypatch.setattr(EntryLaw, "interior_mass", exact_mass)
    monkeypatch.setattr(law, "_solved", lambda hist: solved.append(1) or PlacementTable(hist, law.MAX_PLACED))
    original = ThinningFlopAware.flop_efficiency

    def forgetful(self, node):
        efficiency = original(self, node)
        self._last_values = None  # free recomputes every value
        return efficiency

    monkeypatch.setattr(ThinningFlopAware, "flop_efficiency", forgetful)
    uncached = replay()
    assert cached[3] and solved and any(reused_sums), "the trace must thin, solve tables and reuse sums"
    assert cached[:3] == uncached[:3]


def test_a_plan_uses_its_own_input_length_when_other_requests_matched_since():
    """dp kept the last match's input length on the admission every request shares: a batch's rows (all matched,
    then planned: hf_resume.py) or threads placed the input-end state at another request's input length."""
    def warm_core():
        core = PrefixCacheCore(1 << 40, "dp", tiny_spec(True), 4, alpha=0.0)
        for _ in range(2):  # a repeated prompt: dp now keeps a state at each input's end
            replay_request(core, np.arange(100, 130), np.array([7, 7]))
        return core

    a_input, a_output, b_input = np.arange(1000, 1040), np.arange(5000, 5005), np.arange(2000, 2010)
    a_tokens = np.concatenate([a_input, a_output])
    core = warm_core()
    alone = core.plan(a_tokens, match := core.match(a_input))
    core.release(match)
    assert 40 in alone
    core = warm_core()
    match, other = core.match(a_input), core.match(b_input)
    assert core.plan(a_tokens, match) == alone  # (was 10, B's input length, in place of 40)
    core.release(match)
    core.release(other)
