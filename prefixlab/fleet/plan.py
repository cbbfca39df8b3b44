"""The plan of a `prefixlab run`: which process serves which prompt, in which steps, and `prefixlab run --plan`.

`run_batch` (fleet/run.py) decides its plan with `assign_pending` and `process_steps`; `--plan` calls the same two
functions on the same inputs, so the plan it prints is the assignment and order a real run of that command makes:

    prefixlab run prompts.jsonl --model config.json --out out.jsonl --plan --processes 4 [--json]

It reads and validates the prompt file (the tokenizer, the vocabulary and context of the model's config, malformed
lines as --on-error says), leaves out the prompts OUT already holds (as a rerun would; their records must come from
this file's prompts and options, but whether they come from this model is not checked: that needs the weights),
routes the rest over `--processes` processes (default: the launcher's WORLD_SIZE, else 1) and orders each process's
share. It writes nothing. No weights are read or made: the model is built on the meta device (its config, dtype,
generation config and modules: what the router's cost model, the vocabulary check and --hydragen's batching mode
need).

Per process it reports the prompts and their tokens, and what the scheduler's model-free copy of the process's store
(the StoreModel affinity routes against: same --policy, --capacity and cost spec, each step replayed as a store
serves it, schedule.prefill) expects the run to reuse and to prefill, primes included, replaying the process's steps
in order; Hydragen batches reuse what that store holds of their prime, and are not admitted, as in a run. These are
estimates (schedule.py: a store may place a prime's checkpoint elsewhere; batches' padding is not counted; outputs
are not known, so not fed). With affinity routing the router's own predicted loads are reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prefixlab.errors import InvalidInputError
from prefixlab.fleet.prompts import Prompt


def check_options(args: argparse.Namespace) -> None:
    """The routing and order options (a run's and a plan's)."""
    from prefixlab.fleet.router import check_balance_eps
    from prefixlab.fleet.schedule import ASSIGNMENTS

    if args.routing not in ASSIGNMENTS:
        raise InvalidInputError(f"--routing {args.routing!r} is unknown; use one of {', '.join(ASSIGNMENTS)}")
    if args.order not in ("radix", "input"):
        raise InvalidInputError(f"--order {args.order!r}: use radix or input")
    check_balance_eps(args.balance_eps, "--balance-eps")  # (on every process: only the main one plans)
    if args.hydragen and args.order != "radix":
        raise InvalidInputError("--hydragen batches the siblings under radix-order primes: use it with --order radix")


def assign_pending(prompts: Sequence[Prompt], pending: Sequence[int], processes: int, args: argparse.Namespace,
                   store_model) -> tuple[dict[int, int], list[int] | None]:
    """({prompt index: process} for the `pending` prompts, the affinity router's predicted prefill tokens per
    process or None for other routings)."""
    from prefixlab.fleet import schedule

    if not pending:
        return {}, None
    tokens = [prompts[i].tokens for i in pending]
    options = dict(seed=args.seed, balance_eps=args.balance_eps, primed=args.order == "radix", store=store_model)
    if args.routing == "affinity":  # (assign returns affinity_plan's first element)
        assignment, loads = schedule.affinity_plan(tokens, processes, **options)
        loads = [int(x) for x in loads]
    else:
        assignment, loads = schedule.assign(tokens, processes, args.routing, **options), None
    return dict(zip(pending, assignment, strict=True)), loads


def process_steps(prompts: Sequence[Prompt], assignment: dict[int, int], rank: int, args: argparse.Namespace,
                  batching: str | None) -> list:
    """The steps process `rank` serves (serve.serve's: (prompt index, prime length) or ((indices...), prime
    length)), in order."""
    from prefixlab.fleet import schedule, siblings

    mine = [i for i, process in sorted(assignment.items()) if process == rank]
    if args.order != "radix":
        return [(i, 0) for i in mine]
    local = schedule.radix_schedule([prompts[i].tokens for i in mine])
    if batching is None:
        return [(mine[k], length) for k, length in local]
    return [(tuple(mine[k] for k in index) if isinstance(index, tuple) else mine[index], length)
            for index, length in siblings.group_siblings([prompts[i].tokens for i in mine], local, batching,
                                                         max_batch=args.max_batch)]


def estimate(prompts: Sequence[Prompt], steps: Sequence, store_model, batching: str | None, model) -> dict:
    """What one process's steps are expected to do, through a model-free copy of its store (module docstring);
    `model` (on the meta device) decides which prompts leave their batch, as in a run."""
    from prefixlab.fleet.schedule import prefill
    from prefixlab.fleet.serve import served_alone

    core = store_model.core()
    counts = dict(prompts=0, prompt_tokens=0, reused_tokens=0, prime_tokens=0, prefill_tokens=0, primes=0,
                  batches=0, batched_prompts=0)
    ids, batches = [], []

    def done(prompt: Prompt, reused: int) -> None:
        counts["prompts"] += 1
        counts["prompt_tokens"] += len(prompt.tokens)
        counts["reused_tokens"] += reused
        counts["prefill_tokens"] += len(prompt.tokens) - reused
        ids.append(prompt.id)

    def one(prompt: Prompt) -> None:
        done(prompt, len(prompt.tokens) - prefill(core, prompt.tokens))

    for index, length in steps:
        if isinstance(index, tuple):  # as serve.serve: some prompts alone (serve.served_alone), the rest one batch
            group = [prompts[i] for i in index]
            alone = [p for p in group if served_alone(model, p)]
            group = [p for p in group if p not in alone]
            for prompt in alone:
                one(prompt)
            reused = core.peek(group[0].tokens[:length + 1], limit=length)[0] if group else 0
            ragged = len({len(p.tokens) for p in group}) > 1
            if len(group) < 2 or (batching == "rows" and ragged and not reused):  # (served one by one)
                for prompt in group:
                    one(prompt)
                continue
            counts["batches"] += 1
            counts["batched_prompts"] += len(group)
            batches.append([p.id for p in group])
            for prompt in group:
                done(prompt, reused)
        elif length:  # a prime, unless the store already resumes its prefix
            prefix = prompts[index].tokens[:length]
            if core.peek(prefix)[0] < length:
                computed = prefill(core, prefix)
                counts["primes"] += 1
                counts["prime_tokens"] += computed
                counts["prefill_tokens"] += computed
        else:
            one(prompts[index])
    return {**counts, "ids": ids, "batch_ids": batches}


def make_plan(args: argparse.Namespace) -> dict:
    """The plan of `args`' run (module docstring) as one JSON-ready dict."""
    from prefixlab.fleet import loading, outputs
    from prefixlab.fleet.prompts import read_prompts
    from prefixlab.fleet.run import _check_resumed, _hydragen_mode, _store_model
    from prefixlab.fleet.stops import check_model_stop_strings
    from prefixlab.fleet.tokenizer import prompt_tokenizer

    check_options(args)
    processes = args.processes or _world_size()
    out = Path(args.out).resolve()
    if out.is_dir():
        raise InvalidInputError(f"--out {args.out!r} is a folder; pass the path of the output file (OUT.jsonl)")
    tokenizer = prompt_tokenizer(args.tokenizer, args.model)
    model = loading.load_model(args.model, args.seed, meta=True)
    check_model_stop_strings(model, args.model)
    batching = _hydragen_mode(model) if args.hydragen else None
    text_config = model.config.get_text_config()
    prompts = read_prompts(args.prompts, tokenizer, max_new_tokens=args.max_new_tokens, on_error=args.on_error,
                           vocab_size=text_config.vocab_size,
                           max_positions=getattr(text_config, "max_position_embeddings", None))
    store_model = _store_model(args, model)
    done = outputs.finished(out) if out.parent.is_dir() else {}
    _check_resumed(out, prompts, done, None)
    pending = [p.index for p in prompts if p.id not in done]
    assignment, loads = assign_pending(prompts, pending, processes, args, store_model)
    per_process = [{"process": rank, **estimate(prompts, process_steps(prompts, assignment, rank, args, batching),
                                                store_model, batching, model)} for rank in range(processes)]
    work = np.array([p["prefill_tokens"] for p in per_process], dtype=np.float64)
    totals = {key: sum(p[key] for p in per_process) for key in
              ("prompt_tokens", "reused_tokens", "prime_tokens", "prefill_tokens", "batches", "batched_prompts")}
    return {"prompts": len(prompts), "resumed": len(prompts) - len(pending), "pending": len(pending),
            "processes": processes, "routing": args.routing, "order": args.order, "hydragen": args.hydragen,
            "batching": batching, **totals,
            "load_imbalance": float(work.max() / work.mean()) if work.mean() else 1.0,
            "router_loads": loads, "per_process": per_process}


def _world_size() -> int:
    """The launcher's process count, which --plan plans for without --processes (checked: it is the user's env)."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not (value.strip().isascii() and value.strip().isdigit()) or int(value) < 1:
        raise InvalidInputError(f"WORLD_SIZE={value!r} is not a positive int; pass --processes N (or unset it)")
    return int(value)


def format_plan(plan: dict, out: str) -> str:
    lines = [f"plan: {plan['pending']} of {plan['prompts']} prompts to serve ({plan['resumed']} already in {out}) on "
             f"{plan['processes']} processes ({plan['routing']} routing, {plan['order']} order"
             f"{', hydragen batches' if plan['batching'] else ''}); estimates of the store model, no weights loaded"]
    for p in plan["per_process"]:
        lines.append(f"process {p['process']}: {p['prompts']} prompts, {p['prompt_tokens']} prompt tokens, "
                     f"{p['reused_tokens']} reused, {p['prefill_tokens']} prefilled (of which {p['prime_tokens']} in "
                     f"{p['primes']} primes)" + (f", {p['batched_prompts']} prompts in {p['batches']} batches"
                                                 if p["batches"] else "")
                     + (f"; router's load {plan['router_loads'][p['process']]}" if plan["router_loads"] else ""))
    lines.append(f"total: {plan['prompt_tokens']} prompt tokens, {plan['reused_tokens']} reused, "
                 f"{plan['prefill_tokens']} prefilled; load imbalance {plan['load_imbalance']:.3f} (max/mean "
                 "prefilled tokens)")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """`prefixlab run --plan`: print the plan (one JSON object with --json). Under a launcher only the first
    process prints it."""
    plan = make_plan(args)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(plan) if args.json else format_plan(plan, args.out), flush=True)
    sys.stdout.flush()
    return 0
