"""`prefixlab demo`: serve a chat + shared-system-prompt workload on a tiny Qwen3.5-architecture hybrid, once
without prefixlab and once with it, and show that reuse is exact and how much prefill time it saves.

The model is random-init (3 GatedDeltaNet : 1 attention, fp32), so its answers are noise, but its cost per token
is real. Each request runs both ways back to back (so machine load hits both alike); TTFT is the time from calling
generate() to the first token's logits. Prompts come from ../shared/data (real system prompts and LMSYS chats,
GPT-NeoX tokenizer) when present, else from a built-in text with a byte tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prefixlab.cli import positive_int
from prefixlab.data import shared_file

SYSTEM_PROMPT_TOKENS = 2048  # each shared system prompt is cut to this many tokens
MESSAGE_TOKENS = 40  # each question / chat message is cut to this many tokens
SYSTEM_PROMPTS = 2
CHATS = 3

BUILTIN_TEXT = (
    "You are a careful assistant for a public library. Answer questions about opening hours, borrowing rules, "
    "interlibrary loans, study rooms, printing, accessibility services and events. Be brief, cite the rule you "
    "apply, never invent policies, and ask a clarifying question when a request is ambiguous. "
)
BUILTIN_QUESTIONS = [
    "How many books can I borrow at once?", "Is the library open on public holidays?",
    "Can I renew a loan online?", "Where can I print a document?", "Do you have rooms for group study?",
    "How do I request a book from another library?", "Are there events for children this month?",
    "What happens if I return a book late?", "Can I bring food into the reading room?",
    "Is there step-free access to the second floor?", "How do I get a library card?", "Can I borrow e-books?",
]


@dataclass(frozen=True)
class Request:
    """One user message: a question to a shared system prompt, or the next turn of a chat."""

    kind: str  # "system-prompt" or "chat"
    group: int  # which system prompt / which chat
    message: list[int]


@dataclass
class Served:
    request: Request
    prompt_tokens: int
    hit_tokens: int
    baseline_seconds: float  # wall-clock TTFT
    cached_seconds: float
    identical: bool
    baseline_cpu_seconds: float = 0.0  # this process's CPU time to the first token (immune to other processes)
    cached_cpu_seconds: float = 0.0
    reason: str = "cold"  # why it reused no more (prefixlab.cache.explain.REASONS)
    shared_tokens: int = 0  # how far the store shared the prompt (the reused part reaches its deepest checkpoint)
    sequence: tuple[int, ...] = ()  # prompt + generated tokens


def _encoder():
    """(encode(texts) -> ids lists, vocab_size, source description)."""
    tokenizer = shared_file("tokenizers/gpt-neox-20b.json")
    if tokenizer is None:
        return (lambda texts: [list(t.encode()) for t in texts]), 256, "built-in text, byte tokenizer"
    from prefixlab.sim.build import TextEncoder

    encode = TextEncoder(tokenizer)
    return encode, encode.vocab_size, "../shared/data (system prompts + LMSYS chats, GPT-NeoX tokenizer)"


def _jsonl(relative: str) -> Iterator[dict]:
    path = shared_file(relative)
    if path is None:
        return
    with open(path, encoding="utf-8") as lines:
        yield from (json.loads(line) for line in lines if line.strip())


def _texts():
    """(system prompt texts, questions, chats as lists of user messages)."""
    long_enough = 8 * SYSTEM_PROMPT_TOKENS  # characters: comfortably more than SYSTEM_PROMPT_TOKENS tokens
    prompts = [obj["text"] for obj in _jsonl("system_prompts/system_prompts.jsonl") if len(obj["text"]) > long_enough]
    chats, questions = [], []
    for obj in _jsonl("traces/lmsys_chat_1000.jsonl"):
        users = [m["content"] for m in obj["conversation"] if m.get("role") == "user" and m.get("content")]
        (chats if len(users) >= 4 and len(chats) < CHATS else questions).append(users)
    if len(prompts) < SYSTEM_PROMPTS or len(chats) < CHATS:
        prompts = [f"[{name}] " + BUILTIN_TEXT * 40 for name in ("desk", "archive")]
        questions = [[q] for q in BUILTIN_QUESTIONS]
        chats = [BUILTIN_QUESTIONS[i::CHATS] for i in range(CHATS)]
    return prompts[:SYSTEM_PROMPTS], [q[0] for q in questions], chats


def build_workload(num_requests: int, encode) -> tuple[list[list[int]], list[Request]]:
    """System prompt token lists and `num_requests` requests: questions over the system prompts interleaved with
    chat turns (2 questions for each chat turn; chat c runs under system prompt c % 2)."""
    prompts, questions, chats = _texts()
    system = [ids[:SYSTEM_PROMPT_TOKENS] for ids in encode(prompts)]
    question_ids = [ids[:MESSAGE_TOKENS] for ids in encode(questions)]
    chat_ids = [[ids[:MESSAGE_TOKENS] for ids in encode(turns)] for turns in chats]
    requests, next_turn = [], [0] * len(chat_ids)
    for i in range(num_requests):
        if i % 3 == 2:
            chat = (i // 3) % len(chat_ids)
            turns = chat_ids[chat]
            requests.append(Request("chat", chat, turns[next_turn[chat] % len(turns)]))
            next_turn[chat] += 1
        else:
            requests.append(Request("system-prompt", i % len(system), question_ids[i % len(question_ids)]))
    return system, requests


def tiny_hybrid_config(vocab_size: int, **overrides):
    """The config of a tiny Qwen3.5-architecture hybrid: 3 GatedDeltaNet layers and 1 attention layer (`overrides`
    replace any field, e.g. a bigger model for a GPU)."""
    from transformers import Qwen3_5TextConfig

    fields = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, tie_word_embeddings=True, pad_token_id=0, eos_token_id=None,
    )
    return Qwen3_5TextConfig(**{**fields, **overrides})


def build_model(vocab_size: int):
    """The tiny random-init hybrid (tiny_hybrid_config), fp32, with its GatedDeltaNet layers patched (prefixlab
    kernels: they resume from and record states inside one forward)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from prefixlab.recurrent.patch import patch

    torch.manual_seed(0)
    return patch(Qwen3_5ForCausalLM(tiny_hybrid_config(vocab_size)).eval())


def _timed_generate(model, input_ids, max_new_tokens: int, cache=None):
    """(generated ids, wall seconds and process CPU seconds to the first token's logits)."""
    from transformers import LogitsProcessorList

    from prefixlab.fleet.serve import FirstTokenClock

    clock = FirstTokenClock()
    start = time.perf_counter(), time.process_time()
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    return out, clock.at[0] - start[0], clock.at[1] - start[1]


def serve(model, store, system: list[list[int]], requests: list[Request], max_new_tokens: int,
          progress) -> list[Served]:
    """Run every request without and with prefixlab; chats carry their history (prompt + answer) forward."""
    import torch

    from prefixlab.cache.hf import HybridPrefixCache

    histories: dict[int, list[int]] = {}
    served = []
    for request in requests:
        if request.kind == "chat":
            history = histories.get(request.group) or system[request.group % len(system)]
            prompt = history + request.message
        else:
            prompt = system[request.group] + request.message
        input_ids = torch.tensor([prompt])
        baseline, baseline_seconds, baseline_cpu = _timed_generate(model, input_ids, max_new_tokens)
        cache = HybridPrefixCache(store)
        cached, cached_seconds, cached_cpu = _timed_generate(model, input_ids, max_new_tokens, cache)
        store.flush()  # admit now, after the response, as a server would (else the next lookup does it)
        if request.kind == "chat":
            histories[request.group] = baseline[0].tolist()
        row = cache.report().rows[0]
        served.append(Served(request, len(prompt), cache.reused_tokens, baseline_seconds, cached_seconds,
                             torch.equal(baseline, cached), baseline_cpu, cached_cpu, row.reason, row.shared,
                             tuple(baseline[0].tolist())))
        progress.update(1)
        last = served[-1]
        progress.write(f"{len(served):3d} {request.kind:13s} prompt {last.prompt_tokens:5d}  hit {last.hit_tokens:5d}  "
                       f"TTFT {last.baseline_seconds * 1e3:7.1f} ms -> {last.cached_seconds * 1e3:7.1f} ms  "
                       f"{last.reason}{'' if last.identical else '  TOKENS DIFFER'}")
    return served


def summarize(served: list[Served]) -> tuple[str, bool]:
    from prefixlab.cache.explain import REASONS, format_reasons

    base = np.array([s.baseline_seconds for s in served]) * 1e3
    cached = np.array([s.cached_seconds for s in served]) * 1e3
    identical = all(s.identical for s in served)
    cpu_base = sum(s.baseline_cpu_seconds for s in served)
    cpu_cached = sum(s.cached_cpu_seconds for s in served)
    hit = sum(s.hit_tokens for s in served)
    total = sum(s.prompt_tokens for s in served)
    lines = [
        f"requests: {len(served)}; prompt tokens reused: {hit} of {total} ({hit / total:.0%})",
        "why each request reused what it did: "
        + format_reasons({reason: sum(s.reason == reason for s in served) for reason in REASONS}),
        f"TTFT without prefixlab: P50 {np.percentile(base, 50):.1f} ms, P95 {np.percentile(base, 95):.1f} ms",
        f"TTFT with prefixlab:    P50 {np.percentile(cached, 50):.1f} ms, P95 {np.percentile(cached, 95):.1f} ms",
        f"total prefill time (wall): {base.sum() / 1e3:.2f} s -> {cached.sum() / 1e3:.2f} s "
        f"(speedup {base.sum() / cached.sum():.1f}x)",
        f"total prefill time (this process's CPU time): {cpu_base:.2f} s -> {cpu_cached:.2f} s "
        f"(speedup {cpu_base / cpu_cached:.1f}x)",
        "generated tokens identical with and without prefixlab: " + ("yes" if identical else "NO"),
    ]
    return "\n".join(lines), identical


def plot(served: list[Served], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = np.arange(1, len(served) + 1)
    fig, (ttft, hits) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ttft.plot(index, [s.baseline_seconds * 1e3 for s in served], "o-", label="without prefixlab")
    ttft.plot(index, [s.cached_seconds * 1e3 for s in served], "o-", label="with prefixlab")
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend()
    hits.bar(index, [s.prompt_tokens for s in served], color="lightgray", label="prompt tokens")
    hits.bar(index, [s.hit_tokens for s in served], color="tab:green", label="reused from the store")
    hits.set_xlabel("request")
    hits.set_ylabel("tokens")
    hits.legend()
    fig.suptitle("prefixlab demo: tiny Qwen3.5-architecture hybrid on CPU")
    fig.tight_layout()
    from prefixlab.sim.report import save_plot

    save_plot(fig, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from prefixlab.cache.store import PrefixStore
    from prefixlab.sim.report import check_plot_path

    if args.plot:
        check_plot_path(args.plot)  # before the (slow) run
    torch.set_num_threads(1)  # steadier timings on a shared machine; both ways get the same
    encode, vocab_size, source = _encoder()
    system, requests = build_workload(args.requests, encode)
    model = build_model(vocab_size)
    store = PrefixStore(model, capacity=args.capacity, policy=args.policy)
    print(f"model: Qwen3.5-architecture hybrid, 3 GatedDeltaNet + 1 attention layers, fp32, vocab {vocab_size} "
          "(random init; GatedDeltaNet layers patched with prefixlab kernels, the same model both ways)")
    print(f"workload: {len(requests)} requests from {source}; store: {args.policy}, capacity {args.capacity}")
    with torch.inference_mode(), tqdm(total=len(requests), desc="requests", file=sys.stderr) as progress:
        _timed_generate(model, torch.tensor([system[0][:64]]), 1)  # warm-up: first-call allocations
        served = serve(model, store, system, requests, args.max_new_tokens, progress)
    text, identical = summarize(served)
    print(text)
    stats = store.stats()
    print(f"store: {stats['used_bytes'] / 2**20:.1f} MiB used, {stats['checkpoints']} checkpoints, "
          f"{stats['evictions']} evictions")
    if args.plot:
        plot(served, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if identical else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="serve a workload with and without prefixlab (the main job)")
    demo.add_argument("--requests", type=positive_int, default=40, help="number of requests (default 40)")
    demo.add_argument("--plot", metavar="FILE.png", help="write TTFT and reuse per request to a PNG")
    demo.add_argument("--max-new-tokens", type=positive_int, default=4, help="tokens generated per request (default 4)")
    demo.add_argument("--policy", default="dp", help="store admission policy (default dp)")
    demo.add_argument("--capacity", default="1GB", help="store capacity, e.g. 1GB (the default) or 256MiB")
    demo.set_defaults(func=run)
