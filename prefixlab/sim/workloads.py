"""Synthetic workload shapes no shared file provides: agentic sessions, few-shot prompts, and mixes of traces.

Token ids are uniform random (GPT-NeoX's vocabulary), so only the sharing structure matters: what is shared,
where requests diverge, how long they stay. Every builder is deterministic given its seed and needs no files.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixlab.errors import InvalidInputError
from prefixlab.sim.build import (
    BUILTIN_VOCAB_SIZE,
    _check_int,
    _check_number,
    conversation_requests,
    finite_arrivals,
    poisson_arrivals,
    popularity_weights,
    random_tokens,
    shared_prefix_requests,
)
from prefixlab.sim.trace import Request


def agentic_trace(
    seed: int = 0,
    num_sessions: int = 40,
    turns: tuple[int, int] = (4, 16),
    sessions_per_second: float = 0.2,
    seconds_per_turn: float = 4.0,
    max_context_tokens: int = 32768,
) -> list[Request]:
    """Tool-using agent sessions: each turn appends the model's tool call and the tool's output to the history.

    Sessions open with one of three tool-definition prompts (1-3k tokens, Zipf popularity) and a task (50-300
    tokens); a turn's output is a tool call (20-120 tokens), the next input adds the tool's output (100-1500
    tokens). Sessions start Poisson at `sessions_per_second`, turns follow every ~`seconds_per_turn` (exponential),
    and a session stops before its context would pass `max_context_tokens`.
    """
    _check_int("seed", seed, 0)
    _check_int("num_sessions", num_sessions, 0, count=True)
    _check_number("sessions_per_second", sessions_per_second)
    _check_number("seconds_per_turn", seconds_per_turn)
    _check_int("max_context_tokens", max_context_tokens, 1)
    low, high = turns
    _check_int("turns[0]", low, 1)
    _check_int("turns[1]", high, low)
    rng = np.random.default_rng(seed)
    tools = [random_tokens(rng, (1000, 3000), BUILTIN_VOCAB_SIZE) for _ in range(3)]
    popularity = popularity_weights(len(tools), 1.0, rng)
    starts = poisson_arrivals(num_sessions, sessions_per_second, rng)
    words_per_second = 1.0  # conversation_requests spaces turns by words: one "word" is one second here
    requests: list[Request] = []
    for k, start in enumerate(starts.tolist()):
        session = []
        for turn in range(int(rng.integers(low, high + 1))):
            if turn == 0:
                user = np.concatenate([tools[rng.choice(len(tools), p=popularity)],
                                       random_tokens(rng, (50, 300), BUILTIN_VOCAB_SIZE)])
            else:
                user = random_tokens(rng, (100, 1500), BUILTIN_VOCAB_SIZE)
            call = random_tokens(rng, (20, 120), BUILTIN_VOCAB_SIZE)
            session.append((user.tolist(), call.tolist(), rng.exponential(seconds_per_turn) * words_per_second))
        requests += conversation_requests(f"agent-{k}", session, start, 60.0 * words_per_second, max_context_tokens)
    return finite_arrivals(sorted(requests, key=lambda r: r.ts), f"sessions_per_second={sessions_per_second:g} and "
                           f"seconds_per_turn={seconds_per_turn:g}", "pass a larger rate or a shorter turn time")


def few_shot_trace(
    seed: int = 0,
    num_requests: int = 600,
    num_tasks: int = 6,
    pool_size: int = 24,
    shots: tuple[int, int] = (3, 8),
    requests_per_second: float = 1.0,
) -> list[Request]:
    """Few-shot prompts with varying example sets: a task's instruction (200-600 tokens) + k examples + a query.

    Each task has a pool of `pool_size` examples (80-300 tokens) in a canonical order. A request keeps the first
    j (uniform in 0..k) canonical examples and fills the other k - j shots with random examples of the pool, so
    requests of a task share its instruction plus a varying number of examples and diverge at varying depths.
    Tasks are drawn with Zipf(1) popularity, arrivals are Poisson.
    """
    _check_int("seed", seed, 0)
    _check_int("num_requests", num_requests, 1, count=True)
    _check_int("num_tasks", num_tasks, 1)
    _check_int("pool_size", pool_size, 1)
    low, high = shots
    _check_int("shots[0]", low, 0)
    _check_int("shots[1]", high, max(low, 0))
    if high > pool_size:
        raise InvalidInputError(f"shots={shots} asks for more examples than pool_size={pool_size}")
    _check_number("requests_per_second", requests_per_second)
    rng = np.random.default_rng(seed)
    instructions = [random_tokens(rng, (200, 600), BUILTIN_VOCAB_SIZE) for _ in range(num_tasks)]
    pools = [[random_tokens(rng, (80, 300), BUILTIN_VOCAB_SIZE) for _ in range(pool_size)] for _ in range(num_tasks)]

    def sample_query(query_rng: np.random.Generator, task: int) -> tuple[np.ndarray, np.ndarray]:
        k = int(query_rng.integers(low, high + 1))
        kept = int(query_rng.integers(0, k + 1))
        rest = query_rng.permutation(np.arange(kept, pool_size))[: k - kept]
        examples = [pools[task][i] for i in [*range(kept), *rest.tolist()]]
        query = random_tokens(query_rng, (20, 80), BUILTIN_VOCAB_SIZE)
        return np.concatenate([*examples, query]), random_tokens(query_rng, (10, 60), BUILTIN_VOCAB_SIZE)

    return shared_prefix_requests(instructions, sample_query, num_requests, requests_per_second, 1.0, seed)


def mix_traces(traces: Sequence[Sequence[Request]], names: Sequence[str] | None = None) -> list[Request]:
    """Interleave traces by arrival time, each stretched to the longest one's time span so they overlap evenly.

    Session ids get the trace's name (or index) as a prefix; order within a trace is kept."""
    if not traces or any(not isinstance(t, Sequence) for t in traces):
        raise InvalidInputError("traces must be a non-empty list of request lists")
    names = [str(i) for i in range(len(traces))] if names is None else list(names)
    if len(names) != len(traces):
        raise InvalidInputError(f"got {len(names)} names for {len(traces)} traces")
    if len(set(names)) != len(names):  # the session ids of two traces would collide
        raise InvalidInputError(f"trace names must be unique, got {names}")
    spans = [max((r.ts for r in t), default=0.0) - min((r.ts for r in t), default=0.0) for t in traces]
    target = max(spans)
    mixed = []
    for name, trace, span in zip(names, traces, spans, strict=True):
        first = min((r.ts for r in trace), default=0.0)
        scale = target / span if span > 0 else 1.0
        mixed += [Request(f"{name}/{r.session_id}", r.turn_id, (r.ts - first) * scale, r.input_tokens,
                          r.output_tokens) for r in trace]
    shortest = min((span for span in spans if span > 0), default=0.0)
    return finite_arrivals(sorted(mixed, key=lambda r: r.ts), f"stretching each trace to the longest one's "
                           f"{target:g} s span (the shortest spans {shortest:g} s)", "fix the traces' timestamps (s)")
