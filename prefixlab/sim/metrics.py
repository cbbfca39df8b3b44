"""Replay metrics: token and request hit rates, FLOPs saved and modeled time to first token."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prefixlab.cache.costmodel import ModelSpec


@dataclass(frozen=True)
class SimResult:
    """One replay. Hit rates are percentages; TTFT is the modeled prefill time of the tokens not reused."""

    policy: str
    capacity_bytes: int
    requests: int
    input_tokens: int
    reused_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    flops_saved: float
    ttft_p50_s: float
    ttft_p95_s: float
    alpha: float | None = None
    evictions: int = 0
    replay_seconds: float = 0.0
    tuning_seconds: float = 0.0  # alpha tuning replays: inline, part of replay_seconds; with a lag, on their thread

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(
    policy: str, capacity_bytes: int, input_lengths: np.ndarray, hit_lengths: np.ndarray, spec: ModelSpec, **extra
) -> SimResult:
    """Metrics of a replay from each request's input length and reused length (vectorised)."""
    input_lengths = np.asarray(input_lengths, dtype=np.int64)
    hit_lengths = np.asarray(hit_lengths, dtype=np.int64)
    total = int(input_lengths.sum())
    reused = int(hit_lengths.sum())
    ttft = spec.prefill_seconds(input_lengths - hit_lengths, hit_lengths) if len(input_lengths) else np.zeros(1)
    return SimResult(
        policy=policy,
        capacity_bytes=int(capacity_bytes),
        requests=len(input_lengths),
        input_tokens=total,
        reused_tokens=reused,
        token_hit_rate=100.0 * reused / max(total, 1),
        request_hit_rate=100.0 * float(np.mean(hit_lengths > 0)) if len(hit_lengths) else 0.0,
        flops_saved=float(np.sum(spec.flops_saved(hit_lengths))),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p95_s=float(np.percentile(ttft, 95)),
        **extra,
    )
