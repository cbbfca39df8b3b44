"""Simulator speed: replay time per (policy, capacity) on the LMSys chat trace, and growth with trace size.

Run with `make bench` (or `python -m pytest benchmarks/test_bench_sim.py --benchmark-enable -s`); each test
prints what it measured. With benchmarks disabled (`make test`) they are skipped: a replay sweep is not a test.
"""

import time

import numpy as np
import pytest

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.data import absent, shared_file
from prefixlab.sim.build import build_conversation_trace
from prefixlab.sim.replay import simulate
from prefixlab.sim.trace import Request

GB = 10**9


@pytest.fixture(autouse=True)
def only_when_benchmarking(request):
    options = request.config.getoption
    if options("benchmark_disable", False) and not options("benchmark_enable", False):
        pytest.skip("simulator benchmarks run with --benchmark-enable (make bench)")


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_name("marconi-7b")


@pytest.fixture(scope="module")
def lmsys():
    paths = "traces/lmsys_chat_1000.jsonl", "tokenizers/gpt-neox-20b.json"
    if reason := absent(*paths):
        pytest.skip(reason)
    return build_conversation_trace(*map(shared_file, paths), 1.0)


@pytest.mark.parametrize("gb", [1, 2, 5])
@pytest.mark.parametrize("policy", ["vllm+", "sglang+", "marconi", "dp"])
def test_replay_time_per_policy_and_capacity(benchmark, lmsys, spec, policy, gb):
    result = benchmark.pedantic(simulate, args=(lmsys, policy, gb * GB, spec), rounds=3, iterations=1)
    tokens = sum(len(r.input_tokens) for r in lmsys)
    print(
        f"\n{policy:8s} {gb} GB: {benchmark.stats.stats.min:.3f} s min / {benchmark.stats.stats.mean:.3f} s mean "
        f"for {len(lmsys)} requests ({tokens} input tokens), token hit {result.token_hit_rate:.2f} %, "
        f"alpha {result.alpha}"
    )


def _doubled(requests: list[Request], vocab_offset: int = 1 << 20) -> list[Request]:
    """The trace followed by a copy on disjoint token ids: twice the tokens, the same sharing structure."""
    span = max(r.ts for r in requests) + 1.0
    copy = [
        Request(f"copy-{r.session_id}", r.turn_id, r.ts + span, r.input_tokens + vocab_offset,
                r.output_tokens + vocab_offset)
        for r in requests
    ]
    return requests + copy


@pytest.mark.parametrize("policy", ["sglang+", "marconi"])
def test_replay_time_grows_linearly_with_trace_tokens(benchmark, lmsys, spec, policy):
    sizes = {}
    for name, trace in (("1x", lmsys), ("2x", _doubled(lmsys))):
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            simulate(trace, policy, 2 * GB, spec, alpha=0.5)  # fixed alpha: the replay itself, no tuning window
            runs.append(time.perf_counter() - started)
        sizes[name] = (sum(len(r.input_tokens) for r in trace), min(runs))
    benchmark.pedantic(simulate, args=(lmsys, policy, 2 * GB, spec), kwargs={"alpha": 0.5}, rounds=1, iterations=1)
    (tokens_1x, seconds_1x), (tokens_2x, seconds_2x) = sizes["1x"], sizes["2x"]
    ratio = seconds_2x / seconds_1x
    print(
        f"\n{policy} 2 GB (alpha fixed): {tokens_1x} tokens in {seconds_1x:.3f} s, {tokens_2x} tokens in "
        f"{seconds_2x:.3f} s: x{ratio:.2f} time for x{tokens_2x / tokens_1x:.2f} tokens "
        f"({np.mean([seconds_1x / tokens_1x, seconds_2x / tokens_2x]) * 1e9:.0f} ns per input token)"
    )
    assert ratio < 3.0  # linear gives ~2, quadratic 4


REFERENCE = {  # token hit rate (%) of the public Marconi simulator on the same trace
    "vllm+": (7.55, 9.47, 17.74),
    "sglang+": (25.09, 52.94, 78.99),
    "marconi": (26.65, 54.28, 82.53),
    "dp": (None, None, None),
}


def test_faithfulness_table(benchmark, lmsys, spec):
    """The Marconi-simulator comparison as a markdown table (Marconi-compatible overflow and strict budget)."""
    def table() -> list[str]:
        rows = ["| policy | GB | Marconi sim | prefixlab | prefixlab, strict budget | alpha | replay s |",
                "|---" * 7 + "|"]
        for policy, reference in REFERENCE.items():
            for gb, ref in zip((1, 2, 5), reference, strict=True):
                result = simulate(lmsys, policy, gb * GB, spec)
                strict = simulate(lmsys, policy, gb * GB, spec, overflow=False)
                rows.append(
                    f"| {policy} | {gb} | {ref if ref is not None else '-'} | {result.token_hit_rate:.2f} | "
                    f"{strict.token_hit_rate:.2f} | {result.alpha if result.alpha is not None else '-'} | "
                    f"{result.replay_seconds:.2f} |"
                )
        return rows

    rows = benchmark.pedantic(table, rounds=1, iterations=1)  # the row: the whole table's replays
    print("\n" + "\n".join(rows))


def test_system_prompt_versions_table(benchmark, spec):
    """dp and the heuristic placements against marconi where prompts diverge at varying depths."""
    paths = "system_prompts/system_prompts.jsonl", "tokenizers/gpt-neox-20b.json"
    if reason := absent(*paths):
        pytest.skip(reason)
    from prefixlab.sim.build import build_shared_prefix_trace
    from prefixlab.sim.replay import ceiling

    trace = build_shared_prefix_trace(*map(shared_file, paths), num_requests=1000)
    rows = [f"ceiling (infinite cache): {ceiling(trace, spec).token_hit_rate:.2f} %",
            "| policy | 2 GB | 5 GB | 10 GB |", "|---|---|---|---|"]

    def rates(policy: str) -> list[float]:
        return [simulate(trace, policy, gb * GB, spec).token_hit_rate for gb in (2, 5, 10)]

    policies = ("sglang+", "marconi", "dp", "marconi+balanced", "marconi+log", "vllm+")
    by_policy = benchmark.pedantic(lambda: {p: rates(p) for p in policies}, rounds=1, iterations=1)  # the row: all
    rows += [f"| {policy} | " + " | ".join(f"{r:.2f}" for r in by_policy[policy]) + " |" for policy in policies]
    print("\n" + "\n".join(rows))


def test_alpha_tuning_off_the_request_path(spec):
    """A store's alpha tuning (benchmarks/alpha_stall.py): inline, one request waits for the replays; on the
    background thread (the store's default) none does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from alpha_stall import serve

    from prefixlab.sim.build import builtin_trace

    trace = builtin_trace()
    inline, background = (serve(trace, spec, int(0.5 * GB), "dp", lag, 0.002) for lag in (0, None))
    print(f"\nbuiltin, dp, 0.5 GB, 2 ms a request: slowest request inline {inline['max_ms']:.1f} ms (tuning "
          f"{inline['tuning_ms']:.1f} ms), background {background['max_ms']:.1f} ms (waited "
          f"{background['tuning_wait_ms']:.3f} ms of {background['tuning_ms']:.1f} ms)")
    assert inline["tuning_wait_ms"] == inline["tuning_ms"] > 0 and background["tuning_ms"] > 0
    assert background["tuning_wait_ms"] < inline["tuning_wait_ms"]
