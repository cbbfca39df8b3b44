"""How `prefixlab run` plans affinity routing: against a model-free copy of each process's store
(prefixlab.fleet.schedule.StoreModel) or the fallback (a process keeps everything it was sent).

    python benchmarks/plan_fleet.py /tmp/sysprompt10k.jsonl --prompts 3000 --processes 8 --capacity-gb 0.3,2

The prompts are a trace's input tokens (first --prompts of them, file order). For each (order, capacity, processes,
plan) it prints the planning time and what the plan costs when each process serves its share as `prefixlab run`
does (radix order with primes, or input order: schedule.served_work) through a store of that capacity (the same
core the model uses, marconi-7b costs, outputs not modelled): prefilled tokens (primes included) per prompt token
and max / mean per process. One JSON line per row with --json.
"""

from __future__ import annotations

import argparse
import json
import time

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.fleet.schedule import StoreModel, assign, served_work
from prefixlab.sim.formats import read_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--prompts", type=int, default=None, help="the first N requests (default all)")
    parser.add_argument("--processes", default="8", help="comma-separated process counts")
    parser.add_argument("--capacity-gb", default="2", help="comma-separated store capacities per process, GB")
    parser.add_argument("--policy", default="dp")
    parser.add_argument("--order", default="radix,input", help="radix (primed, the default of run) and/or input")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if unknown := [v for v in args.order.split(",") if v not in ("radix", "input")]:
        parser.error(f"--order: unknown {', '.join(unknown)}; use radix and/or input")
    prompts = [r.input_tokens for r in read_trace(args.trace)[: args.prompts]]
    total = sum(len(p) for p in prompts)
    spec = ModelSpec.from_name("marconi-7b")
    for order in args.order.split(","):
        for capacity_gb in map(float, args.capacity_gb.split(",")):
            store = StoreModel(args.policy, int(capacity_gb * 1e9), spec)
            for processes in map(int, args.processes.split(",")):
                for plan_name, model in (("fallback", None), ("store model", store)):
                    started = time.perf_counter()
                    plan = assign(prompts, processes, "affinity", primed=order == "radix", store=model)
                    seconds = time.perf_counter() - started
                    work = served_work(prompts, plan, processes, store, order == "radix")
                    row = {"order": order, "capacity_gb": capacity_gb, "processes": processes, "plan": plan_name,
                           "prompts": len(prompts), "prompt_tokens": total, "plan_seconds": round(seconds, 2),
                           "prefilled_per_prompt_token": round(work.sum() / total, 4),
                           "load_imbalance": round(work.max() / work.mean(), 3)}
                    print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
