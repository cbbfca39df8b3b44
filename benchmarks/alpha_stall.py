"""The alpha tuning's stall on a serving store: inline (the simulator's) vs in the background (PrefixStore's default).

A store tunes alpha once or twice in its life by replaying its window for every alpha of the grid; inline, the
admission that makes a tuning due waits for all of it, i.e. one request's latency grows by the whole tuning.
This replays a trace through the store's core (size-only payloads, as the tuner's replays are) with a stand-in for
each request's model time (`--serve-ms`, a sleep: a forward's kernels release the GIL as a sleep does), and prints
per lag the slowest requests' latency, the tuning's own time, how long admissions waited for it, and the hit rate.

    python benchmarks/alpha_stall.py TRACE.jsonl --capacity-gb 16 --serve-ms 5 --lags 0,none
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.replay import replay_request
from prefixlab.sim import formats
from prefixlab.sim.cli import load_spec


def serve(requests, spec, capacity_bytes: int, policy: str, lag: int | None, serve_seconds: float) -> dict:
    core = PrefixCacheCore(capacity_bytes, policy, spec, tuning_lag_requests=lag)
    latencies, reused, prompt_tokens = [], 0, 0
    for request in requests:
        started = time.perf_counter()
        time.sleep(serve_seconds)  # the model's forward
        reused += replay_request(core, request.input_tokens, request.output_tokens)
        latencies.append(time.perf_counter() - started)
        prompt_tokens += len(request.input_tokens)
    slowest = np.sort(latencies)[::-1] * 1e3
    return dict(lag_requests=lag, alpha=core.alpha, max_ms=slowest[0], second_max_ms=slowest[1],
                p999_ms=float(np.quantile(latencies, 0.999) * 1e3), tuning_ms=core.tuning_seconds * 1e3,
                tuning_wait_ms=core.tuning_wait_seconds * 1e3, token_hit_rate=100 * reused / prompt_tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--capacity-gb", type=float, default=16.0)
    parser.add_argument("--policy", default="dp")
    parser.add_argument("--model", default="marconi-7b")
    parser.add_argument("--serve-ms", type=float, default=5.0, help="each request's model time (a sleep)")
    parser.add_argument("--lags", default="0,none", help="tuning_lag_requests values, comma-separated (none: "
                                                          "applied once found, the store's default)")
    parser.add_argument("--requests", type=int, default=None, help="the first N requests of the trace")
    args = parser.parse_args()
    requests = formats.read_trace(args.trace)[: args.requests]
    spec = load_spec(args.model)
    for lag in (None if x.strip().lower() == "none" else int(x) for x in args.lags.split(",")):
        row = serve(requests, spec, int(args.capacity_gb * 1e9), args.policy, lag, args.serve_ms / 1e3)
        print(json.dumps(dict(trace=args.trace, requests=len(requests), capacity_gb=args.capacity_gb,
                              policy=args.policy, serve_ms=args.serve_ms, **row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
