"""recurrent.patch speed (`make bench`): a patched model's prefill, prefill with captures, decode step and resume
from a cached prefix, against the same model unpatched. Random-init models of a few hundred hidden units; the
sweep runs only with --benchmark-enable, a small smoke case always runs."""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from prefixlab.recurrent import patch, unpatch

_SHAPES = {
    "qwen3_5_text": dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                         linear_num_key_heads=4, linear_num_value_heads=8, head_dim=64,
                         layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "bamba": dict(mamba_n_heads=16, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
                  mamba_expand=2, mamba_chunk_size=128, attn_layer_indices=[3]),
}  # fmt: skip


def bench_model(name: str, hidden: int = 256) -> torch.nn.Module:
    config = CONFIG_MAPPING[name](vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=8192, **_SHAPES[name])  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _timed_ms(run, cache: DynamicCache | None = None) -> float:
    """One call of run(cache copy), the copy made before the clock starts (a forward mutates its cache)."""
    fresh = None if cache is None else copy.deepcopy(cache)
    start = time.perf_counter()
    run(fresh)
    return (time.perf_counter() - start) * 1e3


def _run(model, ids, cache=None, start=0):
    positions = torch.arange(start, start + ids.shape[1])[None]
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=cache is not None, position_ids=positions).logits


class _Capturing(DynamicCache):
    def __init__(self, config, offsets):
        super().__init__(config=config)
        self.prefixlab_capture_positions = offsets
        self.recorded = 0

    def prefixlab_record(self, layer_idx, offset, conv_state, recurrent_state):
        self.recorded += 1


def bench_patch(name: str, length: int, resume_from: int, captures: int = 8, rounds: int = 5) -> dict:
    """Median milliseconds of: prefill of `length` tokens (unpatched / patched / patched recording `captures`
    states), one decode step after it (unpatched / patched), and, patched, the forward over tokens[resume_from:]
    that a prefix-cache hit at `resume_from` leaves. Variants are interleaved round by round, so load from other
    processes shifts them alike; the first round warms up and is dropped."""
    model = bench_model(name)
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(0))
    offsets = [round(length * (i + 1) / captures) for i in range(captures)]
    full, prefix = DynamicCache(config=model.config), DynamicCache(config=model.config)
    _run(model, ids, full)
    _run(model, ids[:, :resume_from], prefix)
    variants = {  # name: (patched, run, cache it continues)
        "unpatched_prefill": (False, lambda _: _run(model, ids), None),
        "patched_prefill": (True, lambda _: _run(model, ids), None),
        "capture_prefill": (True, lambda _: _run(model, ids, _Capturing(model.config, offsets)), None),
        "unpatched_decode": (False, lambda c: _run(model, ids[:, -1:], c, start=length), full),
        "patched_decode": (True, lambda c: _run(model, ids[:, -1:], c, start=length), full),
        "resume": (True, lambda c: _run(model, ids[:, resume_from:], c, start=resume_from), prefix),
    }
    times: dict[str, list[float]] = {key: [] for key in variants}
    try:
        for _ in range(rounds + 1):
            for key, (patched, run, cache) in variants.items():
                (patch if patched else unpatch)(model)
                times[key].append(_timed_ms(run, cache))
    finally:
        unpatch(model)
    return {f"{key}_ms": statistics.median(samples[1:]) for key, samples in times.items()}


def test_bench_smoke_reports_all_fields():
    result = bench_patch("qwen3_5_text", length=32, resume_from=24, captures=2, rounds=1)
    assert set(result) == {"unpatched_prefill_ms", "unpatched_decode_ms", "patched_prefill_ms",
                           "capture_prefill_ms", "patched_decode_ms", "resume_ms"}  # fmt: skip
    assert all(ms > 0 for ms in result.values())


@pytest.mark.parametrize("name", sorted(_SHAPES))
def test_bench_patch_overhead_and_resume(benchmark, name):
    if benchmark.disabled:
        pytest.skip("benchmark: run with --benchmark-enable (make bench)")
    length, resume_from = 1024, 896
    result = benchmark.pedantic(bench_patch, args=(name, length, resume_from), rounds=1)  # the row: all variants
    speedup = result["patched_prefill_ms"] / result["resume_ms"]
    timings = ", ".join(f"{key} {ms:.1f}" for key, ms in result.items())
    print(f"\n{name} T={length} ({torch.get_num_threads()} threads): {timings}; resume vs prefill {speedup:.1f}x")
    benchmark.extra_info.update(result)
