"""Every request says why it reused what it reused: a workload that constructs each reason on purpose, checked
against the stated reason per request, the counts in store.stats() and exactness against the plain model."""

import warnings

import numpy as np
import pytest
import torch
from hf_models import build
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.explain import REASONS, EvictionLog, format_reasons


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


def tokens(*shape, seed=0):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


def serve(model, store, input_ids, namespace="default", **kwargs):
    """Generate with a cache over `store`; check the output against the plain model; return the cache's report."""
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0) | kwargs
    cache = HybridPrefixCache(store, namespace)
    assert torch.equal(model.generate(input_ids, past_key_values=cache, **options),
                       model.generate(input_ids, **options))
    return cache.report()


def test_each_reason_is_stated_for_the_request_built_to_cause_it(model):
    store = PrefixStore(model, capacity="64MB", policy="marconi", block_size=4)
    a = tokens(1, 20, seed=1)
    branch = lambda seed: torch.cat([a[:, :12], tokens(1, 8, seed=seed)], dim=1)  # noqa: E731
    expected, reports = [], []

    def expect(reason, report):
        expected.append(reason)
        reports.append(report)
        assert report.reasons == [reason], str(report)
        return report.rows[0]

    row = expect("cold", serve(model, store, a))
    assert (row.reused, row.shared, row.checkpoint) == (0, 0, 0)
    row = expect("hit", serve(model, store, a))
    assert (row.reused, row.shared, row.checkpoint) == (19, 19, 19)
    # first sight of the branch point at 12: Marconi holds no state there yet, captures one now
    row = expect("no_checkpoint", serve(model, store, branch(2)))
    assert (row.reused, row.shared, row.checkpoint) == (0, 12, 0)
    row = expect("hit", serve(model, store, branch(3)))
    assert (row.reused, row.shared) == (12, 12)
    row = expect("other_namespace", serve(model, store, a, namespace="tenant-b"))
    assert row.reused == 0
    expect("too_short", serve(model, store, a[:, :1]))
    right_padded = torch.cat([a[:, :10], torch.zeros(1, 2, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 2)], dim=1).long()
    expect("refused_input", serve(model, store, right_padded, attention_mask=mask))
    # a batch resumes at one column: a's row (checkpoint 19) drops to the branch checkpoint at 12 of the other row.
    # Prefilled in chunks of 10: before the first forward rows are primed to one column (align.py), but the first
    # chunk holds neither checkpoint, and the later chunk resumes at one column without priming
    batch = serve(model, store, torch.cat([a, branch(4)]), prefill_chunk_size=10)
    assert batch.reasons == ["batch_alignment", "hit"], str(batch)
    assert [(r.reused, r.checkpoint) for r in batch.rows] == [(12, 19), (12, 12)]
    expected += batch.reasons
    assert "admitted" in batch.admission and batch.admitted_tokens > 0 and batch.admitted_states > 0

    counts = store.stats()["reasons"]
    assert counts == {reason: expected.count(reason) for reason in REASONS}
    assert store.stats()["miss_reasons"] == {r: n for r, n in counts.items() if r != "hit"}
    assert "batch_alignment 1" in format_reasons(counts)
    text = str(batch)
    assert "row 1: reused 12 of 20 prompt tokens" in text and REASONS["batch_alignment"] in text
    store.close()


def test_evicted_is_told_from_never_cached_and_a_refused_admission_is_reported(model):
    first, second, third = tokens(1, 40, seed=5), tokens(1, 40, seed=6), tokens(1, 40, seed=7)
    probe = PrefixStore(model, capacity="16MB", policy="marconi", block_size=4)
    serve(model, probe, first)
    entry_bytes = probe.stats()["used_bytes"]
    probe.close()
    store = PrefixStore(model, capacity=entry_bytes + entry_bytes // 2, policy="marconi", block_size=4)
    serve(model, store, first)
    serve(model, store, second)  # evicts first's entry
    assert store.stats()["evictions"] > 0
    assert serve(model, store, first).reasons == ["evicted"]
    assert serve(model, store, third).reasons == ["cold"]
    store.close()
    tiny = PrefixStore(model, capacity=1024, policy="marconi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = serve(model, tiny, first)
    assert report.refused_rows == 1 and "refused for capacity" in str(report)
    tiny.close()


def test_the_eviction_log_is_bounded_and_forgets_the_oldest_first():
    log = EvictionLog(max_entries=3)
    sequences = [np.arange(10) + 100 * i for i in range(4)]
    for seq in sequences:
        log.record("default", seq, [5, 10])
    assert len(log) == 3
    assert not log.evicted_between("default", sequences[0], 0, 10)  # forgotten
    assert not log.evicted_between("default", sequences[1], 5, 10)  # its depth-10 entry was the one forgotten
    assert log.evicted_between("default", sequences[3], 0, 5) and log.evicted_between("default", sequences[3], 5, 10)
    assert not log.evicted_between("default", sequences[3], 10, 40)  # nothing deeper
    assert not log.evicted_between("tenant", sequences[3], 0, 10)  # namespaces apart


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 2), min_size=1, max_size=6),
                          st.lists(st.integers(1, 6), min_size=1, max_size=3)), max_size=12),
       st.integers(1, 6))
def test_the_eviction_log_remembers_exactly_its_most_recent_entries(records, max_entries):
    """Against a model: the last `max_entries` distinct (namespace, prefix) records, re-recording one refreshes it."""
    log, model = EvictionLog(max_entries), []
    for namespace, seq, depths in records:
        seq = np.array(seq)
        for depth in sorted({min(d, len(seq)) for d in depths}):
            key = (namespace, tuple(seq[:depth]))
            model = [k for k in model if k != key] + [key]
        model = model[-max_entries:]
        log.record(namespace, seq, [min(d, len(seq)) for d in depths])
    assert len(log) == len(model)
    for namespace, seq, _ in records:
        for low in range(len(seq) + 1):
            for high in range(low, len(seq) + 1):
                expected = any((namespace, tuple(seq[:d])) in model for d in range(low + 1, high + 1))
                assert log.evicted_between(namespace, np.array(seq), low, high) == expected


@pytest.mark.parametrize("policy", ["dp", "marconi"])
def test_one_namespace_per_request_keeps_no_bookkeeping_of_namespaces_gone(policy):
    """Tenants or sessions as namespaces: the eviction log kept a counter per namespace ever seen and dp kept an
    entry kind for every namespace root an eviction emptied; memory grew with the namespaces while used_bytes stayed
    flat."""
    from hf_models import config

    from prefixlab.cache.core import PrefixCacheCore
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.cache.replay import replay_request

    spec = ModelSpec.from_config(config("qwen3_5"))
    core = PrefixCacheCore(200 * spec.kv_bytes_per_token + 4 * spec.state_bytes, policy, spec, alpha=0.5,
                           explain=True)
    core.evicted.max_entries = 16
    rng = np.random.default_rng(0)
    for i in range(300):
        replay_request(core, rng.integers(3, 128, 60), rng.integers(3, 128, 4), namespace=f"tenant-{i}")
    assert len(core.evicted) <= 16 and len(core.evicted._depths) <= 16
    assert len(getattr(core.admission, "_kinds", ())) <= sum(1 for _ in core.tree.nodes())
