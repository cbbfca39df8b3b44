"""What a restart mid-trace costs dp (PrefixStore.save, then PrefixStore.load): the second half's token hit rate with
no restart, after a load as it is now (a tier loaded as saved is rebuilt with its policy state: cache/restore.py,
`restarted`, the functions load runs, on size-only payloads), after the load before the policy state was kept
(modelled as `load` still does it for files without one: a fresh core of the same budget re-admitting every leaf's
path with its states, in the tree's order, and the settled alpha) and after such a load that tunes alpha anew.
Requests replay as a store serves them (replay_as_store).

    PREFIXLAB_SHARED_DATA=../shared/data .venv/bin/python benchmarks/restart_alpha.py system-prompts:2 lmsys:1
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from test_bench_dp import MODEL, knee_bytes, traces

from prefixlab.cache.alpha import settle_alpha, settled_alpha
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.payload import SizedKV, SizedState
from prefixlab.cache.persist_entries import restore_marks
from prefixlab.cache.replay import replay_as_store
from prefixlab.cache.restore import restarted

SPEC = ModelSpec.from_name(MODEL)


def reloaded(core: PrefixCacheCore, keep_alpha: bool) -> PrefixCacheCore:
    fresh = PrefixCacheCore(core.capacity_bytes, "dp", SPEC, core.options.block_size, tuning_lag_requests=0)
    entries = []
    for leaf in (n for n in list(core.tree.nodes()) if not n.is_root and not n.children):
        path = [n for n in reversed(leaf.ancestors()) if not n.is_root]
        tokens = np.concatenate([n.tokens for n in path])
        states = {p: SizedState(SPEC.state_bytes) for n in path for p in n.ckpt_pos}
        fresh.admit(tokens, lambda a, b: SizedKV(b - a, SPEC.kv_bytes_per_token), states, namespace=leaf.namespace,
                    restore=True)
        marks = {n.end: (n.branched, n.truncated, n.resumed) for n in path if n.branched or n.truncated or n.resumed}
        entries.append((tokens, None, None, leaf.namespace, marks))
    restore_marks(fresh, entries)  # (what load restores besides the entries: strict budgets read them)
    if keep_alpha and settled_alpha(core) is not None:
        settle_alpha(fresh, settled_alpha(core))
    return fresh


def second_half_hit_rate(requests: list, capacity: int, restart: str) -> tuple[float, float]:
    core = PrefixCacheCore(capacity, "dp", SPEC, 32, tuning_lag_requests=0)
    half, hits, tokens = len(requests) // 2, 0, 0
    for i, request in enumerate(requests):
        if i == half and restart != "none":
            if restart == "state kept" and core.bootstrap is None:
                core = restarted(core)
            else:  # (a load re-admits a tier still tuning alpha: it has no policy state)
                core = reloaded(core, keep_alpha=restart != "tuned anew")
        hit = replay_as_store(core, request.tokens, len(request.input_tokens))
        if i >= half:
            hits, tokens = hits + hit, tokens + len(request.input_tokens)
    return 100 * hits / tokens, core.alpha


def main(points: list[str]) -> None:
    print("| trace | x knee | no restart % (alpha) | load now: policy state kept % (alpha) | load before: entries + "
          "alpha % (alpha) | entries, tuned anew % (alpha) |")
    print("|---|---|---|---|---|---|")
    with ProcessPoolExecutor(1) as pool:
        for point in points:
            name, multiple = point.split(":")
            requests = traces([name])[name]
            capacity = int(knee_bytes(requests, SPEC, pool)[0] * float(multiple))
            cells = [second_half_hit_rate(requests, capacity, restart)
                     for restart in ("none", "state kept", "alpha kept", "tuned anew")]
            print(f"| {name} | {multiple} | " + " | ".join(f"{rate:.2f} ({alpha:g})" for rate, alpha in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["system-prompts:1", "system-prompts:2", "lmsys:1", "lmsys:2", "mix:1", "agentic:2"])
