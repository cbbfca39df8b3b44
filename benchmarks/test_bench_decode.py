"""A decode step through HybridPrefixCache against the same model's plain transformers cache (decode_overhead.py):
the demo's tiny Qwen3.5-architecture hybrid (GatedDeltaNet) and a Bamba (Mamba2) of its width, CPU fp32, one thread.
At this size a step is mostly host time, as on a GPU where small kernels wait on the host.

Run with `make bench`; each test prints what it measured. With benchmarks disabled (`make test`) they are skipped.
"""

import pytest
import torch
from decode_overhead import measure

from prefixlab.bench import wall_clock_note


@pytest.fixture(autouse=True)
def only_when_benchmarking(request):
    options = request.config.getoption
    if options("benchmark_disable", False) and not options("benchmark_enable", False):
        pytest.skip("decode benchmarks run with --benchmark-enable (make bench)")


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_decode_step_costs_at_most_1_15x_plain(benchmark, family):
    torch.set_num_threads(1)
    record = benchmark.pedantic(measure, kwargs=dict(family=family, steps=300, device="cpu"), rounds=1, iterations=1)
    print(f"\n{family}: decode step {record['prefixlab_step_ms']:.3f} ms through prefixlab vs "
          f"{record['plain_step_ms']:.3f} ms plain (median of {record['steps']} interleaved steps): "
          f"{record['ratio']:.3f}x; tokens identical {record['tokens_identical']}")
    assert record["tokens_identical"]
    assert record["ratio"] <= 1.15, f"{record['ratio']:.3f}x ({wall_clock_note()})"
