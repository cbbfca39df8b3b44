"""Trace reading and building speed; each benchmark prints what it measured (`make bench`)."""

import json

import pytest

from prefixlab.data import absent, shared_file
from prefixlab.sim.build import build_conversation_trace, build_shared_prefix_trace, builtin_trace
from prefixlab.sim.formats import read_trace, write_trace


def report(benchmark, what: str, tokens: int) -> None:
    """Print the mean time and throughput (only measured with --benchmark-enable; a plain test run checks it works)."""
    if benchmark.stats is None:
        return
    mean_s = benchmark.stats.stats.mean
    print(f"\n{what}: {mean_s * 1e3:.1f} ms mean, {tokens / mean_s / 1e6:.2f} M tokens/s ({tokens} tokens)")


def shared_or_skip(benchmark, relative: str):
    """A shared data file; skipped when absent or when benchmarking is off (the builds take seconds)."""
    if benchmark.disabled:
        pytest.skip("building from shared data is timed only with --benchmark-enable (make bench)")
    if reason := absent(relative):
        pytest.skip(reason)
    return shared_file(relative)


def test_read_marconi_jsonl(benchmark, tmp_path):
    path = tmp_path / "builtin.jsonl"
    write_trace(path, builtin_trace())
    requests = benchmark(read_trace, path)
    tokens = sum(len(r.tokens) for r in requests)
    report(benchmark, f"read_trace Marconi JSONL, {len(requests)} requests, {path.stat().st_size / 1e6:.1f} MB", tokens)


def test_read_mooncake_jsonl(benchmark, tmp_path):
    path = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 7700 + i % 400, "output_length": 300, "hash_ids": list(range(i, i + 16))}
        for i in range(1000)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    requests = benchmark(read_trace, path)
    report(benchmark, "read_trace Mooncake JSONL, 1000 requests", sum(len(r.tokens) for r in requests))


def test_build_lmsys_conversation_trace(benchmark):
    conversations, tokenizer = (
        shared_or_skip(benchmark, "traces/lmsys_chat_1000.jsonl"),
        shared_or_skip(benchmark, "tokenizers/gpt-neox-20b.json"),
    )
    requests = benchmark.pedantic(build_conversation_trace, args=(conversations, tokenizer), rounds=3, iterations=1)
    report(
        benchmark,
        f"build_conversation_trace LMSys, {len(requests)} requests",
        sum(len(r.input_tokens) for r in requests),
    )


def test_build_system_prompt_trace(benchmark):
    prompts, tokenizer = (
        shared_or_skip(benchmark, "system_prompts/system_prompts.jsonl"),
        shared_or_skip(benchmark, "tokenizers/gpt-neox-20b.json"),
    )
    requests = benchmark.pedantic(build_shared_prefix_trace, args=(prompts, tokenizer), rounds=3, iterations=1)
    report(
        benchmark,
        f"build_shared_prefix_trace system prompts, {len(requests)} requests",
        sum(len(r.input_tokens) for r in requests),
    )
