"""Where a fleet of replicas loses token hits against one cache of the fleet's total size (issue 11's share).

    python benchmarks/fleet_loss.py sp0.jsonl --replicas 8 --capacity-gb 2

Replays the trace through one cache of replicas x capacity and through `replicas` caches of `capacity` behind the
affinity router (the simulator's code: `prefixlab simulate --replicas N --routing affinity --single-cache`), and
prints: both hit rates; the tokens each request could have resumed on the replica holding the most of it when it
arrived (the replicas' contents as they were: what a better choice of replica alone would add); the loss by how
many requests share a request's group (the session id before its first "-": a shared-prefix trace's prompt); and
on how many replicas each group was served.
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.fleet.router import make_router
from prefixlab.sim.formats import read_trace
from prefixlab.sim.replay import replay_request

BUCKETS = ((1, 5), (6, 20), (21, 60), (61, 200), (201, None))


def replay(requests, replicas: int, capacity_bytes: int, spec: ModelSpec, policy: str):
    """Per request: (tokens reused, the replica it went to, the most any replica could resume when it arrived)."""
    cores = [PrefixCacheCore(capacity_bytes, policy, spec, 32) for _ in range(replicas)]
    router = make_router("affinity", replicas, caches=cores) if replicas > 1 else None
    hits, homes, best = (np.zeros(len(requests), dtype=np.int64) for _ in range(3))
    for i, request in enumerate(requests):
        best[i] = max(core.peek(request.input_tokens)[0] for core in cores)
        homes[i] = router.choose(request.input_tokens).replica if router else 0
        hits[i] = replay_request(cores[homes[i]], request.input_tokens, request.output_tokens)
        if router:
            router.record(int(homes[i]), request.tokens, len(request.input_tokens) - int(hits[i]))
    return hits, homes, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--capacity-gb", type=float, default=2.0, help="per replica")
    parser.add_argument("--policy", default="dp")
    parser.add_argument("--model", default="marconi-7b")
    args = parser.parse_args()
    requests, spec = read_trace(args.trace), ModelSpec.from_name(args.model)
    capacity = int(args.capacity_gb * 1e9)
    one, _, _ = replay(requests, 1, args.replicas * capacity, spec, args.policy)
    fleet, homes, best = replay(requests, args.replicas, capacity, spec, args.policy)
    lengths = np.array([len(r.input_tokens) for r in requests])
    total = lengths.sum()
    print(f"token hit rate: one cache {100 * one.sum() / total:.2f} %, fleet {100 * fleet.sum() / total:.2f} %, "
          f"fleet routed to the best resume at arrival {100 * best.sum() / total:.2f} %")
    groups = [r.session_id.split("-")[0] for r in requests]
    sizes = Counter(groups)
    for low, high in BUCKETS:
        mask = np.array([low <= sizes[g] and (high is None or sizes[g] <= high) for g in groups])
        if mask.any():
            print(f"groups of {low}-{high or 'more'} requests: {100 * lengths[mask].sum() / total:.1f} % of tokens, "
                  f"hit one {100 * one[mask].sum() / lengths[mask].sum():.1f} % / fleet "
                  f"{100 * fleet[mask].sum() / lengths[mask].sum():.1f} %, "
                  f"{100 * (one[mask].sum() - fleet[mask].sum()) / total:+.2f} points lost")
    served_on = {g: set() for g in sizes}
    for group, home in zip(groups, homes.tolist(), strict=True):
        served_on[group].add(home)
    print(f"{len(sizes)} groups served on {np.mean([len(s) for s in served_on.values()]):.2f} replicas each on "
          "average over the trace")


if __name__ == "__main__":
    main()
