"""Batch serving over Accelerate processes: reuse, balance and exactness per routing and in-process order.

    accelerate launch --multi_gpu --num_processes 2 benchmarks/serve_accelerate.py --cpu \
        --routing affinity,round-robin,partition,random --order radix,input --json

(on a machine without GPUs, `--multi_gpu` starts N CPU processes on gloo; accelerate 1.x's `--cpu` launch flag
starts one.) A shuffled shared-system-prompt workload (real system prompts and LMSys questions, GPT-NeoX
tokenizer, from ../shared/data when present; else built-in text, byte tokenizer) is served by `prefixlab run`'s
code on the tiny random-init hybrid of `prefixlab demo` (3 GatedDeltaNet + 1 attention layers, fp32; with
--attention-only its 4 layers are full attention), once per (routing, order), each on fresh stores. Every output is
checked against the same model without prefixlab. With --json, one JSON line per (routing, order); the last line is
the last one. `--order hydragen` is radix order with `prefixlab run --hydragen` (siblings batched).

With --baseline it also measures what prefixlab is for: the same prompts through a plain `model.generate` loop
without prefixlab (the same processes, each an even slice, batch size 1, the same max_new_tokens, device and
threads), timed in the same launch after a warm-up of both paths; each row then adds the plain loop's requests/s,
generated tokens/s and prefill time (generate() call to first-token logits, summed over the processes) and the
ratios prefixlab / plain. On a GPU machine: `accelerate launch --num_processes N benchmarks/serve_accelerate.py
--baseline --json` (no --cpu).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from prefixlab.demo import BUILTIN_QUESTIONS, BUILTIN_TEXT, tiny_hybrid_config

# --size small: a GPU-sized Qwen3.5-architecture hybrid (about 0.48 B parameters with a byte vocabulary; 18
# GatedDeltaNet + 6 attention layers, Qwen3.5's head shapes), random init like the tiny one
SIZES = {"tiny": {}, "small": dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128)}

SUMMARY_KEYS = ("processes", "requests", "prompt_tokens", "reused_tokens", "prime_tokens", "prefilled_tokens",
                "saved_tokens", "token_hit_rate", "prefill_saved_rate", "load_imbalance", "generated_tokens", "batches",
                "batched_requests", "padding_tokens", "kv_bytes_read", "kv_bytes_held_peak", "prefill_seconds",
                "seconds", "requests_per_second", "generated_tokens_per_second")


def _texts(system_prompts: int, min_chars: int) -> tuple[list[str], list[str], str, object, int]:
    """(system prompts, questions, source, encode(texts) -> ids lists, vocab size)."""
    from prefixlab.data import shared_file

    paths = [shared_file(p) for p in ("system_prompts/system_prompts.jsonl", "traces/lmsys_chat_1000.jsonl",
                                      "tokenizers/gpt-neox-20b.json")]
    if None not in paths:
        from prefixlab.sim.build import TextEncoder

        with open(paths[0]) as lines:
            systems = [t for t in (json.loads(line)["text"] for line in lines) if len(t) > min_chars]
        with open(paths[1]) as lines:
            questions = [m["content"] for m in (json.loads(line)["conversation"][0] for line in lines)
                         if m.get("role") == "user" and m.get("content")]
        encode = TextEncoder(paths[2])
        if len(systems) >= system_prompts:
            return systems, questions, "../shared/data (system prompts, LMSys questions, GPT-NeoX)", encode, \
                encode.vocab_size
    systems = [f"[desk {k}] " + BUILTIN_TEXT * 40 for k in range(system_prompts)]
    return systems, BUILTIN_QUESTIONS, "built-in text, byte tokenizer", \
        (lambda texts: [list(t.encode()) for t in texts]), 256


def workload(system_prompts: int, questions: int, prompt_tokens: int, question_tokens: int, seed: int):
    """(vocab size, source, prompt records): every system prompt with `questions` questions, shuffled."""
    systems, question_texts, source, encode, vocab_size = _texts(system_prompts, 8 * prompt_tokens)
    rng = random.Random(seed)
    system_ids = [ids[:prompt_tokens] for ids in encode(rng.sample(systems, system_prompts))]
    question_ids = [ids[:question_tokens] for ids in encode(question_texts) if ids]
    records = [{"id": f"s{s}q{q}", "input_ids": system_ids[s] + question_ids[rng.randrange(len(question_ids))]}
               for s in range(system_prompts) for q in range(questions)]
    rng.shuffle(records)
    return vocab_size, source, records


def prompt_trie_tokens(token_lists: list[list[int]]) -> int:
    """Tokens in the trie of the prompts: the fewest prompt tokens any order of serving them can prefill."""
    total, previous = 0, []
    for ids in sorted(token_lists):  # sorted, a prompt's longest prefix in the trie is the one it shares with the last
        shared = next((i for i, (a, b) in enumerate(zip(ids, previous, strict=False)) if a != b),
                      min(len(ids), len(previous)))
        total += len(ids) - shared
        previous = ids
    return total


def _run_args(args, prompts: Path, out: Path, routing: str, order: str) -> argparse.Namespace:
    """`prefixlab run`'s arguments for one (routing, order) of this benchmark."""
    return argparse.Namespace(
        prompts=str(prompts), model=str(prompts.parent / "config.json"), out=str(out), tokenizer=None, routing=routing,
        order="radix" if order == "hydragen" else order, hydragen=order == "hydragen", max_batch=args.max_batch,
        max_new_tokens=args.max_new_tokens, capacity=args.capacity, policy="dp", balance_eps=0.15, seed=0,
        on_error="stop", cpu=args.cpu, json=True)


def _serve_plain(state, model, mine) -> tuple[dict, dict]:
    """Every process serves its prompts `mine` through a plain generate() loop: (id -> output ids of all the
    processes, the loop's throughput: wall seconds on the main process, until the slowest one finished)."""
    from accelerate.utils import gather_object

    from prefixlab.fleet import serve

    state.wait_for_everyone()
    started, stats = time.perf_counter(), serve.ProcessStats(process=state.process_index)
    outputs, per_process = serve.serve_plain(model, mine, stats), []
    reference = {}
    for part, process_stats in gather_object([(outputs, stats.as_dict())]):
        reference.update(part)
        per_process.append(process_stats)
    seconds = time.perf_counter() - started
    requests, generated = (sum(g[key] for g in per_process) for key in ("requests", "generated_tokens"))
    return reference, {"requests": requests, "generated_tokens": generated, "seconds": seconds,
            "prefill_seconds": sum(g["prefill_seconds"] for g in per_process),
            "requests_per_second": requests / seconds, "generated_tokens_per_second": generated / seconds}


def _against(row: dict, plain: dict) -> dict:
    """prefixlab's throughput over the plain loop's (> 1: faster), and the plain loop's prefill time over prefixlab's
    (> 1: prefixlab spent less)."""
    return {"throughput_vs_plain": row["requests_per_second"] / plain["requests_per_second"],
            "generated_tokens_per_second_vs_plain":
                row["generated_tokens_per_second"] / plain["generated_tokens_per_second"],
            "prefill_time_vs_plain": plain["prefill_seconds"] / max(row["prefill_seconds"], 1e-9)}


def main() -> int:
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from prefixlab.fleet import launch, loading, serve
    from prefixlab.fleet.prompts import read_prompts
    from prefixlab.fleet.run import run_batch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routing", default="affinity", help="comma-separated: random, round-robin, affinity, "
                                                                "partition")
    parser.add_argument("--order", default="radix", help="comma-separated: radix, input, hydragen (radix order with "
                                                         "the siblings of each prime batched: `run --hydragen`)")
    parser.add_argument("--max-batch", type=int, default=16, help="hydragen order: most prompts in one batch")
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4, help="questions per system prompt")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--capacity", default="256MiB", help="each process's store capacity")
    parser.add_argument("--attention-only", action="store_true", help="every layer full attention (no recurrent "
                                                                       "layer): siblings prefill as one padded batch")
    parser.add_argument("--baseline", action="store_true", help="also time a plain generate() loop without "
                                                                 "prefixlab and print the ratios")
    parser.add_argument("--repeat", type=int, default=1, help="run every path this many times, alternating, and "
                                                               "keep each one's fastest run")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="the model: tiny (demo's, CPU) or "
                                                                            "small (~0.5 B, for a GPU)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from prefixlab.fleet.schedule import ASSIGNMENTS

    for name, given, known in (("--routing", args.routing, ASSIGNMENTS), ("--order", args.order,
                                                                          ("radix", "input", "hydragen"))):
        if unknown := [v for v in given.split(",") if v not in known]:  # (before any model is built)
            parser.error(f"{name}: unknown {', '.join(unknown)}; use {', '.join(known)}")

    state = PartialState(cpu=args.cpu)
    launch.share_cores(state, state.num_processes)  # as `prefixlab run` does, so both paths get the same threads
    shared = [None, None, None]
    if state.is_main_process:
        folder = Path(tempfile.mkdtemp(prefix="serve_accelerate_"))
        vocab_size, source, records = workload(args.system_prompts, args.questions, args.prompt_tokens, 40, 0)
        config = tiny_hybrid_config(vocab_size, **SIZES[args.size])
        if args.attention_only:  # the same model with every layer full attention (no recurrent state)
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        config.to_json_file(folder / "config.json")
        with open(folder / "prompts.jsonl", "w") as file:
            file.writelines(json.dumps(r) + "\n" for r in records)
        with open(folder / "warmup.jsonl", "w") as file:
            file.writelines(json.dumps(r) + "\n" for r in records[:2 * state.num_processes])
        shared = [str(folder), source, prompt_trie_tokens([r["input_ids"] for r in records])]
    broadcast_object_list(shared)
    folder, source, trie_tokens = Path(shared[0]), shared[1], shared[2]

    # the same model without prefixlab, each process an even slice of the prompts: the reference outputs, and with
    # --baseline the timed plain generate() loop
    model = loading.load_model(str(folder / "config.json"), 0, "cpu" if args.cpu else str(state.device))
    prompts = read_prompts(folder / "prompts.jsonl", max_new_tokens=args.max_new_tokens)
    mine = prompts[state.process_index::state.num_processes]
    if args.baseline:  # first-call costs (allocations, kernel selection) out of both timed paths
        serve.serve_plain(model, mine[:1])
        run_batch(_run_args(args, folder / "warmup.jsonl", folder / "warmup-out.jsonl", "round-robin", "radix"))
    rows, plain = {}, None
    for repeat in range(args.repeat):  # alternate the paths; keep each one's fastest run (a shared machine)
        reference, plain_now = _serve_plain(state, model, mine)
        plain = plain_now if plain is None or plain_now["seconds"] < plain["seconds"] else plain
        for routing in args.routing.split(","):
            for order in args.order.split(","):
                out = folder / f"out-{routing}-{order}-{repeat}.jsonl"
                summary = run_batch(_run_args(args, folder / "prompts.jsonl", out, routing, order))
                if not state.is_main_process:
                    continue
                with open(out) as lines:
                    outputs = {r["id"]: r["output_ids"] for r in map(json.loads, lines)}
                row = {"routing": routing, "order": order, **{key: summary[key] for key in SUMMARY_KEYS},
                       "outputs_identical": outputs == reference,
                       "in_input_order": list(outputs) == [p.id for p in prompts],
                       "per_process_prompt_tokens": [g["prompt_tokens"] for g in summary["per_process"]],
                       "workload": source, "prompt_trie_tokens": trie_tokens}
                before = rows.get((routing, order))
                if before is not None:  # every run must be exact; the fastest one's numbers are kept
                    row["outputs_identical"] &= before["outputs_identical"]
                    row["in_input_order"] &= before["in_input_order"]
                rows[routing, order] = row if before is None or row["seconds"] < before["seconds"] else \
                    {**before, "outputs_identical": row["outputs_identical"], "in_input_order": row["in_input_order"]}
    del model
    state.wait_for_everyone()  # every process is done with the folder's files
    if not state.is_main_process:
        return 0
    shutil.rmtree(folder)
    by, rows = rows, list(rows.values())
    for row in rows:
        if args.baseline:
            row.update(plain=plain, repeats=args.repeat, **_against(row, plain))
        print(json.dumps(row) if args.json else
              f"{row['routing']:12s} {row['order']:6s} reused {row['reused_tokens']:7d} saved {row['saved_tokens']:7d} "
              f"prefilled {row['prefilled_tokens']:7d} hit {row['token_hit_rate']:5.1f}% imbalance "
              f"{row['load_imbalance']:.3f} identical {row['outputs_identical']}")
        if args.baseline:
            print(f"{row['routing']}/{row['order']} vs a plain generate loop ({row['processes']} processes, best of "
                  f"{args.repeat}): requests/s {row['requests_per_second']:.2f} vs {plain['requests_per_second']:.2f} "
                  f"(x{row['throughput_vs_plain']:.2f}), generated tokens/s {row['generated_tokens_per_second']:.1f} "
                  f"vs {plain['generated_tokens_per_second']:.1f}, prefill {row['prefill_seconds']:.2f} s vs "
                  f"{plain['prefill_seconds']:.2f} s (x{row['prefill_time_vs_plain']:.2f} less)", file=sys.stderr)
    # saved = prompt tokens never computed (store hits net of the shared-prefix primes that made them)
    for a, b, key, what in ((("affinity", "radix"), ("round-robin", "radix"), "saved_tokens", "saved tokens"),
                            (("partition", "radix"), ("round-robin", "radix"), "saved_tokens", "saved tokens"),
                            (("affinity", "input"), ("round-robin", "input"), "saved_tokens", "saved tokens"),
                            (("affinity", "input"), ("round-robin", "input"), "reused_tokens", "reused tokens")) + \
            tuple(((routing, "input"), (routing, order), key, what) for routing in args.routing.split(",")
                  for order in ("radix", "hydragen") for key, what in (("prefilled_tokens", "prefilled tokens"),
                                                                      ("kv_bytes_read", "decode KV bytes read"),
                                                                      ("seconds", "wall time"))) + \
            tuple(((routing, "radix"), (routing, "hydragen"), key, what) for routing in args.routing.split(",")
                  for key, what in (("kv_bytes_read", "decode KV bytes read"), ("seconds", "wall time"))):
        if a in by and b in by:
            print(f"{'/'.join(a)} vs {'/'.join(b)}: {what} x{by[a][key] / (by[b][key] or 1):.2f}",
                  file=sys.stderr)  # (not max(..., 1): runs under a second would be divided by 1)
    for (routing, order), row in by.items():  # how far each order is from the best any order could do
        print(f"{routing}/{order}: prefilled tokens x{row['prefilled_tokens'] / max(trie_tokens, 1):.2f} the prompt "
              f"trie's {trie_tokens} (no order prefills fewer)", file=sys.stderr)
    return 0 if all(r["outputs_identical"] for r in rows) else 1


if __name__ == "__main__":
    from prefixlab.fleet.launch import exit_process

    exit_process(main())
