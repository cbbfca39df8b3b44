"""Synthetic workloads (prefixlab.sim.workloads): their sharing structure, determinism and bad input."""

import numpy as np
import pytest

from prefixlab.errors import InvalidInputError
from prefixlab.sim.build import builtin_trace
from prefixlab.sim.report import TABLE_COLUMNS, dp_vs_best_other, format_table
from prefixlab.sim.trace import Request
from prefixlab.sim.workloads import agentic_trace, few_shot_trace, mix_traces


def test_agentic_turns_append_to_the_history():
    trace = agentic_trace(seed=3, num_sessions=4, turns=(3, 5))
    assert trace == sorted(trace, key=lambda r: r.ts)
    sessions = {}
    for r in trace:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert [r.turn_id for r in turns] == list(range(len(turns))) and 3 <= len(turns) <= 5
        for before, after in zip(turns, turns[1:], strict=False):
            history = before.tokens
            assert np.array_equal(after.input_tokens[: len(history)], history)
            assert len(after.input_tokens) > len(history)
            assert after.ts > before.ts
    firsts = [turns[0].input_tokens for turns in sessions.values()]
    assert any(np.array_equal(a[:1000], b[:1000]) for i, a in enumerate(firsts) for b in firsts[i + 1:])  # tools
    again = agentic_trace(seed=3, num_sessions=4, turns=(3, 5))
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(trace, again, strict=True))


def test_few_shot_requests_share_instructions_and_diverge_at_varying_depths():
    trace = few_shot_trace(seed=1, num_requests=60, num_tasks=2, pool_size=10, shots=(2, 4))
    assert len(trace) == 60 and all(len(r.output_tokens) >= 10 for r in trace)
    depths = set()
    for i, a in enumerate(trace):
        for b in trace[i + 1:]:
            n = min(len(a.input_tokens), len(b.input_tokens))
            differs = a.input_tokens[:n] != b.input_tokens[:n]
            depths.add(int(np.argmax(differs)) if differs.any() else n)
    assert len([d for d in depths if d >= 200]) > 3  # an instruction (>= 200 tokens) plus a varying number of shots


def test_mix_interleaves_traces_over_one_time_span_keeping_each_order():
    a, b = agentic_trace(num_sessions=3), few_shot_trace(num_requests=20)
    mixed = mix_traces([a, b], ["agent", "shots"])
    assert len(mixed) == len(a) + len(b) and mixed == sorted(mixed, key=lambda r: r.ts)
    for name, trace in (("agent", a), ("shots", b)):
        ours = [r for r in mixed if r.session_id.startswith(name + "/")]
        assert [r.session_id for r in ours] == [f"{name}/{r.session_id}" for r in trace]
        assert ours[-1].ts == pytest.approx(max(max(r.ts for r in a), max(r.ts for r in b)))


def _timed(*times):
    return [Request("s", k, ts, np.arange(3), np.arange(2)) for k, ts in enumerate(times)]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: agentic_trace(num_sessions=-1), "num_sessions"),
        (lambda: agentic_trace(turns=(3, 2)), "turns"),
        (lambda: agentic_trace(sessions_per_second=0), "sessions_per_second"),
        (lambda: few_shot_trace(num_requests=0), "num_requests"),
        (lambda: few_shot_trace(pool_size=3, shots=(2, 5)), "pool_size"),
        (lambda: mix_traces([]), "non-empty"),
        (lambda: mix_traces([[], []], ["one"]), "names"),
        (lambda: mix_traces([[], []], ["one", "one"]), "unique"),
        # rates and gaps whose arrival times overflow a float (inf): refused naming them, not the first bad ts
        (lambda: agentic_trace(num_sessions=3, sessions_per_second=1e-310), "sessions_per_second=1e-310.*larger"),
        (lambda: agentic_trace(num_sessions=3, seconds_per_turn=1e308), "seconds_per_turn=1e\\+308.*larger"),
        (lambda: few_shot_trace(num_requests=3, requests_per_second=1e-310), "requests_per_second=1e-310"),
        (lambda: mix_traces([_timed(0.0, 1e-300), _timed(0.0, 1e10)]), "longest.*timestamps"),
        # counts numpy cannot size (an OverflowError traceback from `trace build few-shot --num-requests 1e20`)
        (lambda: few_shot_trace(num_requests=10**20), r"num_requests.*2\*\*63"),
        (lambda: agentic_trace(num_sessions=10**20), r"num_sessions.*2\*\*63"),
        (lambda: builtin_trace(num_prompt_requests=10**20), r"num_prompt_requests.*2\*\*63"),
    ],
)
def test_workloads_refuse_bad_input(call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()


def test_degenerate_workloads_still_build():
    assert agentic_trace(num_sessions=0) == []
    assert len(few_shot_trace(num_requests=1, shots=(0, 0))) == 1
    single = few_shot_trace(num_requests=1)
    assert mix_traces([single, []])[0].ts == 0.0


def _row(policy, gb, hit, flops):
    return {"policy": policy, "capacity_gb": gb, "token_hit_rate": hit, "flops_saved": flops}


def test_dp_vs_best_other_per_capacity():
    rows = [_row("marconi", 1, 50.0, 2.0), _row("dp", 1, 49.0, 2.2), _row("sglang+", 1, 51.0, 1.0),
            _row("marconi", 2, 0.0, 0.0), _row("dp", 2, 0.0, 0.0), _row("vllm+", 5, 10.0, 1.0)]
    assert dp_vs_best_other(rows) == [
        {"capacity_gb": 1, "token_hit_pts": -2.0, "best_token_policy": "sglang+",
         "flops_saved_pct": pytest.approx(10.0), "best_flops_policy": "marconi"},
        {"capacity_gb": 2, "token_hit_pts": 0.0, "best_token_policy": "marconi", "flops_saved_pct": 0.0,
         "best_flops_policy": "marconi"},
    ]  # 5 GB has no dp row: no line


def test_dp_vs_best_other_compares_fleet_rows_of_one_routing():
    rows = [{**_row(policy, 1, hit, hit), "replicas": 4, "routing": routing, "ceiling_token_hit_rate": 95.0,
             "ceiling_request_hit_rate": 95.0}
            for policy, routing, hit in [("sglang+", "random", 40.0), ("sglang+", "affinity", 90.0),
                                         ("dp", "random", 45.0), ("dp", "affinity", 89.0)]]
    assert [(c["routing"], c["token_hit_pts"], c["best_token_policy"]) for c in dp_vs_best_other(rows)] == [
        ("random", 5.0, "sglang+"), ("affinity", -1.0, "sglang+")]  # not dp-random against sglang+-affinity
    assert "at 1 GB x 4 replicas, affinity: token hit -1.00 pts" in format_table(rows, TABLE_COLUMNS[:1])


def test_dp_saving_flops_where_every_other_saved_none_is_not_a_percentage():
    """(It printed "FLOPs saved +100.00 %", a doubling, for a saving over nothing: no ratio exists.)"""
    rows = [{**_row("marconi", 1, 0.0, 0.0), "ceiling_token_hit_rate": 80.0, "ceiling_request_hit_rate": 80.0},
            {**_row("dp", 1, 60.0, 5.0e12), "ceiling_token_hit_rate": 80.0, "ceiling_request_hit_rate": 80.0}]
    assert dp_vs_best_other(rows)[0]["flops_saved_pct"] is None
    line = format_table(rows, TABLE_COLUMNS[:1]).splitlines()[-1]
    assert line.endswith("FLOPs saved some where every other saved none (best other marconi)"), line
    assert "%" not in line and "nan" not in line and "inf" not in line
