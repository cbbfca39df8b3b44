"""`prefixlab simulate`, end to end through prefixlab.cli.main (`trace build`: test_trace_cli.py)."""

import json
import os

import pytest
from cli_helpers import assert_one_line_error, only_sim_subcommands, run  # noqa: F401 (an autouse fixture)

import prefixlab.sim.replay
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.sim.build import builtin_trace
from prefixlab.sim.formats import write_trace
from prefixlab.sim.metrics import SimResult
from prefixlab.sim.replay import ceiling, simulate

# Small enough that every policy evicts on the builtin trace (marconi-7b KV is 64 KiB per token).
SMALL_CAPACITIES = "0.3,1"
FAST_POLICIES = "vllm+,sglang+,marconi"


def test_simulate_builtin_json_matches_direct_replay(capsys):
    code, out, _ = run(
        capsys, "simulate", "builtin", "--policy", FAST_POLICIES, "--capacity-gb", SMALL_CAPACITIES, "--json"
    )
    assert code == 0
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [(r["policy"], r["capacity_gb"]) for r in rows] == [
        (p, c) for p in FAST_POLICIES.split(",") for c in (0.3, 1.0)
    ]
    trace, spec = builtin_trace(), ModelSpec.from_name("marconi-7b")
    bound = ceiling(trace, spec)
    for row in rows:
        direct = simulate(trace, row["policy"], round(row["capacity_gb"] * 1e9), spec)
        for key in ("token_hit_rate", "request_hit_rate", "flops_saved", "ttft_p50_s", "ttft_p95_s", "evictions"):
            assert row[key] == pytest.approx(getattr(direct, key)), key
        assert row["capacity_bytes"] == {0.3: 300_000_000, 1.0: 1_000_000_000}[row["capacity_gb"]]
        assert row["ceiling_token_hit_rate"] == pytest.approx(bound.token_hit_rate)
        assert 0 <= row["token_hit_rate"] <= row["ceiling_token_hit_rate"] + 1e-9
    assert any(row["evictions"] > 0 for row in rows) and any(row["token_hit_rate"] > 0 for row in rows)


def fake_result(policy, capacity_bytes, token_hit_rate):
    return SimResult(
        policy,
        capacity_bytes,
        10,
        1000,
        int(token_hit_rate * 10),
        token_hit_rate,
        50.0,
        1.5e15,
        0.125,
        0.5,
        replay_seconds=0.25,
    )


@pytest.fixture
def stand_in_replay(monkeypatch):
    """simulate/ceiling stand-ins with known numbers: token hit rate = 10 x capacity in GB."""
    calls = []

    def fake_simulate(requests, policy, capacity_bytes, spec, progress=None, overflow=True, tuning_lag_requests=0,
                      as_store=False):
        calls.append((len(requests), policy, capacity_bytes, spec.name))
        for _ in requests:
            progress(1)
        return fake_result(policy, capacity_bytes, 10.0 * capacity_bytes / 1e9)

    monkeypatch.setattr(prefixlab.sim.replay, "simulate", fake_simulate)
    monkeypatch.setattr(prefixlab.sim.replay, "ceiling", lambda requests, spec: fake_result("ceiling", 0, 90.0))
    return calls


def test_simulate_table_format(capsys, stand_in_replay):
    code, out, _ = run(capsys, "simulate", "builtin", "--policy", "sglang+, marconi,sglang+", "--capacity-gb", "1,2.5")
    assert code == 0  # a policy named twice runs once
    assert [call[1:] for call in stand_in_replay] == [
        ("sglang+", 10**9, "marconi-7b"),
        ("sglang+", 25 * 10**8, "marconi-7b"),
        ("marconi", 10**9, "marconi-7b"),
        ("marconi", 25 * 10**8, "marconi-7b"),
    ]
    lines = out.strip().splitlines()
    assert lines[0].split() == [
        "policy",
        "capacity",
        "GB",
        "token",
        "hit",
        "%",
        "request",
        "hit",
        "%",
        "FLOPs",
        "saved",
        "TTFT",
        "P50",
        "s",
        "TTFT",
        "P95",
        "s",
        "replay",
        "s",
    ]
    assert lines[2].split() == ["sglang+", "2.5", "25.00", "50.00", "1.500e+15", "0.1250", "0.5000", "0.25"]
    assert lines[3].split()[:3] == ["marconi", "1", "10.00"]
    assert len({len(line) for line in lines[:5]}) == 1  # columns are aligned
    assert lines[5] == "infinite-cache ceiling: token hit 90.00 %, request hit 50.00 %"


def test_simulate_plot(capsys, tmp_path, stand_in_replay):
    plot = tmp_path / "hits.png"
    code, _, err = run(
        capsys, "simulate", "builtin", "--policy", "vllm+,marconi", "--capacity-gb", "1,2,5", "--plot", plot
    )
    assert code == 0 and f"wrote {plot}" in err
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    assert_one_line_error(capsys, "simulate", "builtin", "--plot", tmp_path / "no" / "x.png", match="does not exist")
    assert_one_line_error(capsys, "simulate", "builtin", "--plot", tmp_path / "x.txt", match=".png")
    assert_one_line_error(capsys, "simulate", "builtin", "--plot", "", match=".png")  # (not "no plot")
    (tmp_path / "folder.png").mkdir()
    assert_one_line_error(capsys, "simulate", "builtin", "--plot", tmp_path / "folder.png", match="is a folder")
    assert len(stand_in_replay) == 6  # refused before any replay
    if os.path.isdir("/proc"):  # Linux: no file can be created there (as root too)
        code, _, err = run(capsys, "simulate", "builtin", "--policy", "vllm+", "--capacity-gb", "1", "--plot",
                           "/proc/hits.png")
        assert code == 2 and err.startswith("prefixlab: error: --plot '/proc/hits.png': cannot write"), err


def test_simulate_reads_trace_files_and_skips_bad_lines(capsys, tmp_path, stand_in_replay):
    path, good = tmp_path / "t.jsonl", builtin_trace(num_sessions=2, num_prompt_requests=3)
    write_trace(path, good)
    with path.open("a") as f:
        f.write('{"session_id": "x", "turn_id": 0, "ts": 99, "input_tokens": [1, "two"]}\n')
    line = assert_one_line_error(capsys, "simulate", path, match="t.jsonl:")
    assert "input_tokens" in line and "'two'" in line
    with pytest.warns(UserWarning, match="t.jsonl:"):
        code, _, _ = run(capsys, "simulate", path, "--policy", "marconi", "--capacity-gb", "1", "--on-error", "skip")
    assert code == 0 and stand_in_replay[-1][0] == len(good)
    path.write_text('{"session_id": "x", "turn_id": 0, "ts": NaN, "input_tokens": [1]}\n')  # no line left
    with pytest.warns(UserWarning, match="t.jsonl:1"):
        assert_one_line_error(capsys, "simulate", path, "--on-error", "skip", match="no request left")
    assert stand_in_replay[-1][0] == len(good)  # nothing replayed


def test_simulate_mooncake_trace_end_to_end(capsys, tmp_path):
    rows = [
        {"timestamp": 1000 * i, "input_length": 1400 + 10 * i, "output_length": 20, "hash_ids": [0, 1, 2 + i % 2]}
        for i in range(6)
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run(capsys, "simulate", path, "--policy", "sglang+", "--capacity-gb", "1", "--json")
    row = json.loads(out)
    assert code == 0 and row["requests"] == 6 and row["token_hit_rate"] > 50  # shared 1024-token block prefix


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--policy", "lru"], "valid policies: vllm+, sglang+, marconi, dp"),
        (["--policy", ","], "--policy is empty; use one or more of vllm+"),
        (["--capacity-gb", "0"], "--capacity-gb '0' must be a finite number > 0"),
        (["--capacity-gb", "1,-2"], "must be a finite number > 0"),
        (["--capacity-gb", "big"], "--capacity-gb 'big' is not a number"),
        (["--capacity-gb", "nan"], "must be a finite number > 0"),
        (["--capacity-gb", "inf"], "must be a finite number > 0"),
        (["--capacity-gb", "1e-12"], "below one byte"),
        (["--capacity-gb", "1e300"], "too large to count in bytes"),
        (["--model", "gpt-9"], "gpt-9"),
        (["--model", "/nonexistent/config.json"], "no such config file"),
        (["--on-error", "ignore"], "--on-error 'ignore': use one of stop, skip"),
        (["--tuning-lag", "-1"], "--tuning-lag '-1' must be a finite number >= 0"),
        (["--tuning-lag", "2.5"], "--tuning-lag '2.5' is not an integer"),
        (["--replicas", "2", "--tuning-lag", "soon"], "--tuning-lag 'soon' is not an integer"),
    ],
)
def test_simulate_bad_arguments_exit_2_with_one_line(capsys, argv, match, stand_in_replay):
    assert_one_line_error(capsys, "simulate", "builtin", *argv, match=match)
    assert stand_in_replay == []  # rejected before any replay


@pytest.mark.parametrize(
    "argv, match",
    [
        (["simulate"], "prefixlab simulate: the following arguments are required: trace"),
        (["trace"], "prefixlab trace: the following arguments are required: build"),
        (["trace", "build"], "required: {conversations,shared-prefix,builtin,agentic,few-shot,mix}"),
        (["trace", "build", "builtin"], "prefixlab trace build builtin: the following arguments are required: -o"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        prefixlab.cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("prefixlab: error: ") and match in err


def test_simulate_missing_trace_file(capsys, tmp_path):
    assert_one_line_error(capsys, "simulate", tmp_path / "absent.jsonl", match="does not exist")
    assert_one_line_error(capsys, "simulate", tmp_path, match="is a folder")


def test_model_from_hf_config(capsys, tmp_path, stand_in_replay):
    from transformers import Mamba2Config

    config = Mamba2Config(hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64, state_size=16)
    (tmp_path / "config.json").write_text(config.to_json_string())
    code, _, _ = run(
        capsys, "simulate", "builtin", "--model", tmp_path / "config.json", "--policy", "marconi", "--capacity-gb", "1"
    )
    assert code == 0 and stand_in_replay[0][3] == ModelSpec.from_config(config).name
    code, _, _ = run(capsys, "simulate", "builtin", "--model", tmp_path, "--policy", "marconi", "--capacity-gb", "1")
    assert code == 0  # a folder holding config.json works too
    (tmp_path / "bad.json").write_text('{"hidden_size": 3}')
    assert_one_line_error(capsys, "simulate", "builtin", "--model", tmp_path / "bad.json", match="config.json")
    # a malformed value is named as such (a number where transformers reads the text model's config: was a
    # misleading "model_type None" error) through the same reader as `prefixlab run`'s
    (tmp_path / "bad.json").write_text(config.to_json_string()[:-2] + ', "text_config": 3}')
    assert_one_line_error(capsys, "simulate", "builtin", "--model", tmp_path / "bad.json", match="'text_config' to 3")
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert_one_line_error(capsys, "simulate", "builtin", "--model", tmp_path / "bad.json", match="holds an array")


def test_simulate_does_not_import_torch():
    """`prefixlab simulate` stays light: only the subcommand being run is imported (bench pulls in torch)."""
    import subprocess
    import sys

    code = "import sys; from prefixlab.cli import build_parser; build_parser('simulate'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_simulate_prints_dp_vs_best_other(capsys, stand_in_replay):
    code, out, _ = run(capsys, "simulate", "builtin", "--policy", "marconi,dp", "--capacity-gb", "1")
    assert code == 0
    assert out.strip().splitlines()[-1] == (
        "dp vs best other at 1 GB: token hit +0.00 pts (best other marconi), FLOPs saved +0.00 % "
        "(best other marconi)"
    )


def test_a_capacity_replica_count_or_routing_given_twice_is_one_row(capsys):
    """As a policy given twice: "--replicas 2,2" printed the same fleet twice."""
    code, out, _ = run(capsys, "simulate", "builtin", "--policy", "sglang+,sglang+", "--capacity-gb", "1,1.0",
                       "--replicas", "2,2", "--routing", "random,random", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["policy"], r["capacity_gb"], r["replicas"], r["routing"]) for r in rows] == [
        ("sglang+", 1.0, 2, "random")]
    code, out, _ = run(capsys, "simulate", "builtin", "--policy", "sglang+", "--capacity-gb", "1,1", "--json")
    assert code == 0 and len(out.splitlines()) == 1


def test_simulate_fleet_json_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "fleet.png"
    code, out, err = run(capsys, "simulate", "builtin", "--policy", "sglang+", "--capacity-gb", "1",
                         "--replicas", "1,4", "--routing", "random,affinity", "--single-cache", "--json",
                         "--plot", plot)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["replicas"], r["routing"]) for r in rows] == [(1, "random"), (1, "affinity"),
                                                                         (4, "random"), (4, "affinity")]
    trace, spec = builtin_trace(), ModelSpec.from_name("marconi-7b")
    one = simulate(trace, "sglang+", 10**9, spec)
    for row in rows:
        assert row["requests"] == len(trace) and row["load_imbalance"] >= 1.0
        if row["replicas"] == 1:  # one replica is the plain replay, whatever the routing
            assert row["token_hit_rate"] == one.token_hit_rate == row["single_cache_token_hit_rate"]
    assert rows[3]["token_hit_rate"] > rows[2]["token_hit_rate"]
    assert rows[3]["single_cache_token_hit_rate"] == simulate(trace, "sglang+", 4 * 10**9, spec).token_hit_rate
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {plot}" in err
    code, out, _ = run(capsys, "simulate", "builtin", "--policy", "sglang+", "--capacity-gb", "1", "--replicas", "2",
                       "--routing", "round-robin")
    assert code == 0 and "imbalance" in out.splitlines()[0] and "round-robin" in out.splitlines()[1]
    assert_one_line_error(capsys, "simulate", "builtin", "--replicas", "4", "--routing", "sticky", match="round-robin")
    for fleet_option in (["--routing", "random"], ["--single-cache"], ["--balance-eps", "0.3"]):  # need --replicas
        assert_one_line_error(capsys, "simulate", "builtin", *fleet_option, match="add --replicas N")
    assert_one_line_error(capsys, "simulate", "builtin", "--replicas", "0", match="--replicas")
    # more replicas than requests: refused before any cache is built (--replicas 10000000000 took all memory)
    assert_one_line_error(capsys, "simulate", "builtin", "--replicas", "2,1000", match="more than the trace's")


@pytest.mark.parametrize("fleet", [(), ("--replicas", "2", "--single-cache")])
def test_a_cache_below_one_state_is_explained_and_strict_budget_never_exceeds_it(capsys, tmp_path, fleet):
    """Two identical requests: the overflow rule keeps the first entry (dp checkpoints its input's end) in a 10-byte
    cache, so the second hits; the CLI says so, and --strict-budget gives the strict answer (no hit) and says that."""
    trace = tmp_path / "same.jsonl"
    request = {"input_tokens": [1, 2, 3], "output_tokens": [4]}
    trace.write_text("".join(json.dumps({"session_id": i, "turn_id": 0, "ts": i, **request}) + "\n" for i in (0, 1)))
    hit = {}
    for strict in ((), ("--strict-budget",)):
        code, out, err = run(capsys, "simulate", trace, "--policy", "dp", "--capacity-gb", "1e-8", "--json",
                             *fleet, *strict)
        assert code == 0 and "1e-08 GB holds no recurrent state" in err, err
        assert ("no request can resume" in err) == bool(strict) and ("overflow rule" in err) != bool(strict)
        rows = [json.loads(line) for line in out.strip().splitlines()]
        # (a fleet of two sends the repeat elsewhere: the balance bound; its one cache of twice the size hits)
        hit[bool(strict)] = rows[0]["single_cache_token_hit_rate" if fleet else "token_hit_rate"]
    assert hit == {False: 50, True: 0}
    _, _, err = run(capsys, "simulate", trace, "--policy", "marconi", "--capacity-gb", "1", *fleet)
    assert "holds no recurrent state" not in err


@pytest.mark.parametrize("fleet", [[], ["--replicas", "2"]], ids=["one cache", "fleet"])
def test_a_tuning_lag_replays_the_stores_background_tuning_deterministically(capsys, fleet):
    def rows(*lag):
        code, out, _ = run(capsys, "simulate", "builtin", "--policy", "dp", "--capacity-gb", "0.5", "--json", *fleet,
                           *lag)
        assert code == 0
        return [json.loads(line) for line in out.strip().splitlines()]

    keys = ("token_hit_rate", "alpha", "evictions", "flops_saved")
    inline, lagged, again = rows(), rows("--tuning-lag", "40"), rows("--tuning-lag", "40")
    assert [[row[k] for k in keys] for row in rows("--tuning-lag", "0")] == [[row[k] for k in keys] for row in inline]
    assert lagged[0]["token_hit_rate"] != inline[0]["token_hit_rate"]  # the alpha applied 40 requests later
    assert [[row[k] for k in keys] for row in again] == [[row[k] for k in keys] for row in lagged]


@pytest.mark.parametrize("fleet", [[], ["--replicas", "2", "--routing", "affinity"]], ids=["one cache", "fleet"])
def test_as_store_replays_requests_as_a_prefix_store_serves_them(capsys, fleet):
    """--as-store replays what a PrefixStore does with each request (test_replay.py checks it against a real one):
    a strict budget, and on the builtin trace other hits than Marconi's replay under the same strict budget (the
    state the store keeps before each prompt's last token can also make later requests hit deeper)."""
    def rows(*flags):
        code, out, _ = run(capsys, "simulate", "builtin", "--policy", "marconi", "--capacity-gb", "0.5", "--json",
                           *fleet, *flags)
        assert code == 0
        return [{k: v for k, v in json.loads(line).items() if not k.endswith("seconds")}  # (timings)
                for line in out.strip().splitlines()]

    strict, as_store = rows("--strict-budget"), rows("--as-store")
    assert as_store == rows("--as-store", "--strict-budget") and len(as_store) == 1
    assert as_store[0]["reused_tokens"] != strict[0]["reused_tokens"]  # (fewer on one cache, more on the fleet)
    if not fleet:
        spec, trace = ModelSpec.from_name("marconi-7b"), builtin_trace()
        direct = simulate(trace, "marconi", 500_000_000, spec, overflow=False, as_store=True)
        assert as_store[0]["reused_tokens"] == direct.reused_tokens and as_store[0]["evictions"] == direct.evictions
    with pytest.raises(prefixlab.sim.replay.InvalidInputError, match="overflow=False"):
        simulate(builtin_trace(), "marconi", 10**9, ModelSpec.from_name("marconi-7b"), as_store=True)
