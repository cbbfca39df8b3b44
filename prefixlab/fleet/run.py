"""`prefixlab run PROMPTS.jsonl --model CONFIG_OR_PATH --out OUT.jsonl`: batch inference with prefix reuse, on
one process or many (`accelerate launch --num_processes N -m prefixlab run ...`).

Every process reads the prompt file and builds the same model with its own PrefixStore. The main process routes
the prompts not yet finished (prefixlab.fleet.schedule.assign) and broadcasts the assignment with Accelerate's
collectives; each process serves its share in radix-tree order (or file order with --order input) and appends
results to its own part file; the main process merges them into OUT in file order and prints the summary.

A process that dies: the launcher (torchrun, under `accelerate launch`) stops the others with SIGTERM; they stop
at once and keep what they wrote. Under `accelerate launch --max_restarts K` the launcher then restarts the group:
the restarted processes read the part files like a rerun, so the main process re-plans only the prompts left
unfinished over the whole group and the command completes. Without restarts the main process merges what was
written and lists the prompts lost; rerunning the same command completes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from prefixlab.cache.explain import format_reasons
from prefixlab.cli import positive_int, seed_int
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import launch, outputs
from prefixlab.fleet.tokenizer import PromptTokenizer, prompt_tokenizer


def _store_model(args: argparse.Namespace, model):
    """Each process's store as affinity plans against it (same policy, capacity and cost spec, no tensors)."""
    from prefixlab.cache.costmodel import ModelSpec
    from prefixlab.cache.model_info import parse_capacity
    from prefixlab.fleet.schedule import StoreModel

    spec = ModelSpec.from_config(model.config, dtype=model.dtype)
    return StoreModel(args.policy, parse_capacity(args.capacity), spec)


def _output_digest(model_digest: str, tokenizer: PromptTokenizer | None) -> str:
    """What a run's records are made with: the model, and the tokenizer that decodes their `text` (if any)."""
    if tokenizer is None:
        return model_digest
    return hashlib.sha256(model_digest.encode() + tokenizer.digest()).hexdigest()[:16]


def _earlier_digests(model_digest: str, tokenizer: PromptTokenizer | None) -> dict[str, bool]:
    """{digest: whether only records without `text` may carry it} for the records earlier versions wrote as this run
    writes them: before a tokenizer was digested by its files (and a --model folder's used by default), a run without
    one wrote the model's digest alone (records of input_ids prompts, no `text`: their ids are what any run of this
    model makes of them), a run with a tokenizers JSON file the digest of the model and the file's bytes."""
    earlier = {model_digest: True}
    if tokenizer is not None and tokenizer.path.is_file():
        earlier[hashlib.sha256(model_digest.encode() + tokenizer.path.read_bytes()).hexdigest()[:16]] = False
    return earlier


def _check_resumed(out: Path, prompts: list, done: dict, model_digest: str | None,
                   earlier: dict[str, bool] | None = None) -> None:
    """Records already in OUT must come from this run's prompts, model and tokenizer: a rerun keeps them, so a changed
    prompt, max_new_tokens, model or tokenizer would leave stale outputs behind (records written before fingerprints
    pass; those earlier versions digested otherwise pass by `earlier`, _earlier_digests)."""
    earlier = earlier or {}

    def other_model(record: dict) -> bool:
        made = record.get("model", model_digest)
        return made != model_digest and not (made in earlier and not (earlier[made] and "text" in record))

    changed = [p.id for p in prompts if p.id in done and (done[p.id].get("request", p.fingerprint) != p.fingerprint
                                                          or model_digest is not None  # (None: --plan, no weights)
                                                          and other_model(done[p.id]))]
    if changed:
        raise InvalidInputError(
            f"{out}: {len(changed)} finished records were made from another prompt, max_new_tokens or model (or "
            f"--tokenizer) than this run's, or with other sampling or stop options (ids {changed[:5]}"
            f"{' ...' if len(changed) > 5 else ''}); pass another "
            f"--out, or remove their lines from {out} (and its .part files) to redo them")


class Stopped(Exception):
    """SIGTERM (the launcher stops the group when a process dies): finish cleanly, keep what is written."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the stop in progress must not be cut short by another
    raise Stopped()


def run_batch(args: argparse.Namespace) -> dict | None:
    """The whole run; returns the summary on the main process (None elsewhere)."""
    from accelerate.utils import broadcast_object_list, gather_object

    from prefixlab.cache.store import PrefixStore
    from prefixlab.fleet import loading, serve
    from prefixlab.fleet.plan import assign_pending, check_options, process_steps
    from prefixlab.fleet.prompts import read_prompts

    state = launch.start(args.cpu)
    rank, processes = state.process_index, state.num_processes
    restart, max_restarts = launch.attempt()
    check_options(args)
    out = Path(args.out).resolve()  # a symlink's target: the merge renames a new file over OUT
    if not out.parent.is_dir():
        raise InvalidInputError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    if out.is_dir():
        raise InvalidInputError(f"--out {args.out!r} is a folder; pass the path of the output file (OUT.jsonl)")
    if out.exists() and Path(args.prompts).exists() and out.samefile(args.prompts):
        raise InvalidInputError(f"--out {args.out!r} is the prompt file; pass another path for the outputs")
    if out.exists() and not out.is_file():
        raise InvalidInputError(f"--out {args.out!r} is not a regular file (a pipe or device): the run rewrites OUT "
                                "at the end; pass the path of a file (OUT.jsonl)")
    tokenizer = prompt_tokenizer(args.tokenizer, args.model)
    model = loading.load_model(args.model, args.seed, "cpu" if args.cpu else str(state.device))
    batching = _hydragen_mode(model) if args.hydragen else None
    text_config = model.config.get_text_config()
    prompts = read_prompts(args.prompts, tokenizer, max_new_tokens=args.max_new_tokens, on_error=args.on_error,
                           vocab_size=text_config.vocab_size,
                           max_positions=getattr(text_config, "max_position_embeddings", None))
    if len(prompts) < processes and state.is_main_process:  # (a resumed run often has fewer left: the same)
        print(f"prefixlab: note: {len(prompts)} prompts for {processes} processes; "
              f"{processes - len(prompts)} of them will have nothing to do", file=sys.stderr)
    launch.share_cores(state, processes)
    digests = gather_object([loading.model_digest(model)])
    if len(set(digests)) > 1:
        raise InvalidInputError(f"the processes built different models ({digests}); check --seed and --model")
    digest = _output_digest(digests[0], tokenizer)

    store_model = _store_model(args, model)  # on every process: a bad --policy / --capacity stops them all
    plan = [None, None]  # (already finished, assignment of the pending prompts), decided on the main process
    if state.is_main_process:
        try:
            outputs.claim(out)  # held until the merge (run() lets go of it whatever happens)
            done = outputs.finished(out)
            _check_resumed(out, prompts, done, digest, _earlier_digests(digests[0], tokenizer))
            pending = [p.index for p in prompts if p.id not in done]
            plan = [len(prompts) - len(pending), assign_pending(prompts, pending, processes, args, store_model)[0]]
        except InvalidInputError as err:  # sent as the plan: the others wait for it (else they die of a dead peer)
            broadcast_object_list([str(err), None])
            raise
        if restart:
            print(f"prefixlab: restart {restart} (of at most {max_restarts}): {plan[0]} of {len(prompts)} prompts "
                  f"were done before it; the {len(pending)} left unfinished by the failure are planned again over "
                  f"{processes} processes", file=sys.stderr)
        elif plan[0]:
            print(f"prefixlab: resuming {out}: {plan[0]} of {len(prompts)} prompts already done", file=sys.stderr)
    broadcast_object_list(plan)
    if isinstance(plan[0], str):  # the main process refused OUT or the plan: every process stops with its error
        raise InvalidInputError(plan[0])
    resumed, assignment = plan
    mine = [i for i, process in assignment.items() if process == rank]
    steps = process_steps(prompts, assignment, rank, args, batching)  # (what --plan reports: fleet/plan.py)

    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # from here on a SIGTERM stops the run cleanly
    started, stats, stopped, gathered = time.perf_counter(), serve.ProcessStats(process=rank), False, None
    try:  # a Stopped anywhere in here, even in the RuntimeError handler, is caught (the handler raises it once)
        from tqdm import tqdm

        with ExitStack() as cleanup:
            store = PrefixStore(model, capacity=args.capacity, policy=args.policy)
            cleanup.callback(store.close)
            writer = outputs.PartWriter(out, rank)
            cleanup.callback(writer.close)
            with tqdm(total=len(mine), desc=f"process {rank}", unit="req", file=sys.stderr, disable=None,
                      position=rank) as bar:
                serve.serve(model, store, prompts, steps, launch.with_test_exit(writer.write, rank), process=rank,
                            decode=tokenizer and tokenizer.decode, progress=bar.update, stats=stats,
                            model_digest=digest, stop_tokenizer=tokenizer and tokenizer.stopping_tokenizer())
        try:
            gathered = launch.gather_patiently(stats.as_dict())
        except RuntimeError:  # a peer died while this process waited (torch.distributed's error)
            stopped = "terminated"
    except (Stopped, KeyboardInterrupt) as err:
        stopped = "terminated" if isinstance(err, Stopped) else "interrupted"
    finally:  # once stopped, the launcher's SIGTERM (a peer died) must not cut the summary short: run() restores it
        signal.signal(signal.SIGTERM, signal.SIG_IGN if stopped else previous)
    gathered = gathered or [stats.as_dict()]
    if not state.is_main_process:
        return None
    if stopped == "terminated" and restart < max_restarts:  # the launcher restarts the group, which resumes
        print(f"prefixlab: process {rank} stopped (a process of the group died); the launcher restarts the group "
              f"(restart {restart + 1} of at most {max_restarts}) and it resumes from the part files", file=sys.stderr)
        return None
    # stopped: the others may still be appending to their parts, so keep them (a rerun reads them again)
    written, missing = outputs.merge(out, [p.id for p in prompts], remove_parts=not stopped)
    outputs.release(out)
    summary = _summary(prompts, gathered, written, missing, resumed, time.perf_counter() - started, args)
    return {**summary, "processes": processes, "stopped": bool(stopped), "restarts": restart,
            "lost_at_failure": len(assignment) if restart else 0,
            "redone": len(assignment) - len(missing) if restart else 0}


def _hydragen_mode(model) -> str | None:
    """Switch `model` to Hydragen attention and say how its siblings can batch (prefixlab.fleet.siblings)."""
    import prefixlab.attention  # noqa: F401  (registers attn_implementation="hydragen")
    from prefixlab.fleet.siblings import batching_mode

    previous = model.config._attn_implementation
    try:  # without a HydragenCache it runs transformers' SDPA, bit for bit
        model.set_attn_implementation("hydragen")
        mode = batching_mode(model)
    except (ValueError, NotImplementedError):  # e.g. a model with no attention implementation to set
        mode = None
    from prefixlab.fleet.generation_options import prompt_reading_options

    if mode is not None and (options := prompt_reading_options(model)):
        print(f"prefixlab: note: --hydragen: the model's generation config sets {', '.join(options)}, which read "
              "each prompt's tokens or length (a padded batch would change them); serving prompts one by one",
              file=sys.stderr)
        mode = None
    elif mode is None:
        print(f"prefixlab: note: --hydragen: {type(model).__name__} has no attention layer HydragenCache can share; "
              "serving prompts one by one", file=sys.stderr)
    elif mode == "equal":
        print("prefixlab: note: --hydragen: this model has layers that would run over padding and cannot be joined "
              "row by row: only siblings of equal prompt length are batched, the others are served one by one",
              file=sys.stderr)
    if mode is None and previous is not None and model.config._attn_implementation != previous:
        # one by one runs the model's own attention: hydragen's refuses scores it changes (Inkling's position_bias)
        model.set_attn_implementation(previous)
    return mode


def _summary(prompts, per_process: list[dict], written: int, missing: list, resumed: int, seconds: float,
             args) -> dict:
    total = {key: sum(g[key] for g in per_process) for key in
             ("requests", "prompt_tokens", "reused_tokens", "prime_tokens", "prefilled_tokens", "generated_tokens",
              "batches", "batched_requests", "padding_tokens", "kv_bytes_read", "prefill_seconds")}
    total["kv_bytes_held_peak"] = max(g["kv_bytes_held_peak"] for g in per_process)
    prefilled = [g["prefilled_tokens"] for g in per_process]
    mean = sum(prefilled) / max(len(prefilled), 1)
    reasons, finished = {}, {}
    for process in per_process:
        for reason, count in process["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
        for reason, count in process["finish_reasons"].items():
            finished[reason] = finished.get(reason, 0) + count
    return {
        "prompts": len(prompts), "resumed": resumed, **total, "written": written, "lost": len(missing),
        "lost_ids": missing[:20], "routing": args.routing, "order": args.order, "hydragen": args.hydragen,
        "token_hit_rate": 100.0 * total["reused_tokens"] / max(total["prompt_tokens"], 1),
        # net of the primes: prompt tokens this run did not compute at all
        "saved_tokens": total["prompt_tokens"] - total["prefilled_tokens"],
        "prefill_saved_rate": 100.0 * (total["prompt_tokens"] - total["prefilled_tokens"]) /
                              max(total["prompt_tokens"], 1),
        "load_imbalance": max(prefilled) / mean if mean else 1.0,
        "seconds": seconds, "requests_per_second": total["requests"] / seconds if seconds else 0.0,
        "generated_tokens_per_second": total["generated_tokens"] / seconds if seconds else 0.0,
        "reasons": reasons, "finish_reasons": finished, "per_process": per_process,
    }


def format_summary(summary: dict, out: str) -> str:
    lines = [
        f"requests: {summary['requests']} served now, {summary['resumed']} from a previous run or attempt, "
        f"{summary['written']} of {summary['prompts']} in {out}",
        f"prompt tokens: {summary['prompt_tokens']}, reused from the store: {summary['reused_tokens']} "
        f"({summary['token_hit_rate']:.1f}%), prefilled: {summary['prefilled_tokens']} "
        f"(of which {summary['prime_tokens']} in shared-prefix primes): prefill saved "
        f"{summary['saved_tokens']} tokens ({summary['prefill_saved_rate']:.1f}%)",
        f"processes: {summary['processes']} ({summary['routing']} routing, {summary['order']} order), "
        f"load imbalance {summary['load_imbalance']:.3f} (max/mean prefilled tokens)",
        f"why requests reused what they did: {format_reasons(summary['reasons'])}; generation ended on "
        f"{', '.join(f'{n} {why}' for why, n in sorted(summary['finish_reasons'].items())) or 'none'}",
        f"hydragen: {summary['batched_requests']} requests in {summary['batches']} sibling batches "
        f"({summary['padding_tokens']} padding tokens); decode read {summary['kv_bytes_read'] / 2**20:.1f} MiB of "
        f"attention KV, at most {summary['kv_bytes_held_peak'] / 2**20:.1f} MiB held by one generate call",
        f"throughput: {summary['requests_per_second']:.2f} requests/s, "
        f"{summary['generated_tokens_per_second']:.1f} generated tokens/s over {summary['seconds']:.1f} s "
        f"(prefill {summary['prefill_seconds']:.1f} s summed over the processes)",
    ]
    if summary["restarts"]:
        lines.append(f"restarted {summary['restarts']} time(s) after a process died: {summary['lost_at_failure']} "
                     f"prompts left unfinished by the failure, {summary['redone']} of them redone after the restart "
                     f"(the {summary['resumed']} done before were kept; counts and throughput above are the last "
                     "attempt's)")
    if summary["stopped"]:
        lines.append("STOPPED (a process died or was stopped; the counts above are this process's)")
    if summary["lost"]:
        lines.append(f"NOT DONE: {summary['lost']} prompts (ids {summary['lost_ids']}"
                     f"{' ...' if summary['lost'] > len(summary['lost_ids']) else ''}); rerun the same command to "
                     "finish them")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.plan:
        from prefixlab.fleet.plan import run_plan

        return run_plan(args)
    if args.processes is not None:
        raise InvalidInputError("--processes is for --plan; a run's processes are the launcher's "
                                "(accelerate launch --num_processes N)")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        summary = run_batch(args)
        if summary is None:
            return 0
        print(json.dumps(summary) if args.json else format_summary(summary, args.out), flush=True)
        return 1 if summary["lost"] else 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        outputs.release()
        launch.finish()


def register(subparsers: argparse._SubParsersAction) -> None:
    from prefixlab.fleet.schedule import ASSIGNMENTS

    cmd = subparsers.add_parser("run", help="batch inference over a prompt file with prefix reuse (accelerate-ready)")
    cmd.add_argument("prompts", help="JSONL: one {id, text | messages | input_ids, max_new_tokens?, temperature?, "
                     "top_p?, top_k?, seed?, stop_token_ids?, stop?} object per line")
    cmd.add_argument("--model", required=True, help="config.json (random init, seeded) or a model folder with weights")
    cmd.add_argument("--out", required=True, help="output JSONL (resumed if it exists: finished ids are skipped)")
    cmd.add_argument("--tokenizer", help="a tokenizers JSON file or a transformers tokenizer folder (default: the "
                     "--model folder's own, if any), for text / messages prompts and decoded outputs")
    cmd.add_argument("--routing", default="affinity",
                     help=f"across processes: {', '.join(ASSIGNMENTS)} (default affinity)")
    cmd.add_argument("--order", default="radix",
                     help="within a process: radix (shared prefixes once; the default) or input")
    cmd.add_argument("--hydragen", action="store_true",
                     help="batch the prompts under one primed prefix as one generate batch with Hydragen's shared "
                          "prefix (exact; see prefixlab/fleet/siblings.py; batches are not admitted to the store)")
    cmd.add_argument("--max-batch", type=positive_int, default=16,
                     help="--hydragen: most prompts in one batch (default 16)")
    cmd.add_argument("--max-new-tokens", type=positive_int, default=16,
                     help="for prompts without max_new_tokens (default 16)")
    cmd.add_argument("--capacity", default="1GB",
                     help="each process's store capacity, e.g. 1GB (the default) or 256MiB")
    cmd.add_argument("--policy", default="dp", help="store admission policy (default dp)")
    cmd.add_argument("--balance-eps", type=float, default=0.15,
                     help="affinity: max work (1 + eps) x the mean (default 0.15)")
    cmd.add_argument("--seed", type=seed_int, default=0, help="random-init seed (the same on every process; default 0)")
    cmd.add_argument("--on-error", default="stop", help="malformed prompt lines: stop (default) or skip")
    cmd.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")
    cmd.add_argument("--json", action="store_true", help="print the summary (or the plan) as one JSON object")
    cmd.add_argument("--plan", action="store_true",
                     help="print how the run would route and order the prompts, with the scheduler's estimates of "
                          "reused and prefilled tokens per process, then stop: reads no weights, writes nothing "
                          "(prefixlab/fleet/plan.py)")
    cmd.add_argument("--processes", type=positive_int,
                     help="--plan: the processes to plan for (default: the launcher's WORLD_SIZE, else 1)")
    cmd.set_defaults(func=run)
