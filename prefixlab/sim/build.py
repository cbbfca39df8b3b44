"""Trace builders from raw data: multi-turn conversations, shared-document and system-prompt workloads.

The conversation builder follows the construction of the Marconi paper's LMSys trace: every message is
JSON-encoded on its own (``json.dumps({"role": ..., "content": ...})``, ASCII-escaped) and tokenised on its own,
so turn t's input is exactly turn t-1's input + output tokens followed by the new user message's tokens.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixlab.errors import InvalidInputError, TraceFormatError
from prefixlab.sim.formats import LineError, existing_file, read_json_lines
from prefixlab.sim.trace import Request

WORDS_PER_MINUTE = 90.0  # the typing speed the Marconi trace assumes between turns
# A session stops at the first turn whose input + output would exceed this (Marconi's LMSys trace uses 32k; a later
# fork of its generator uses 8192, which drops 4 of the 1,001 turns of the shared LMSys sample).
MAX_CONTEXT_TOKENS = 32768


class TextEncoder:
    """Batch text -> token ids with a `tokenizers` JSON file; no special tokens are added (Marconi adds none)."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_path)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise InvalidInputError(f"tokenizer_path {str(path)!r} {what}; pass a tokenizers JSON file")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on unreadable files
            raise InvalidInputError(f"tokenizer_path {str(path)!r} is not a tokenizers JSON file ({err})") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def __call__(self, texts: list[str]) -> list[list[int]]:
        # One batch call: the tokenizer parallelises it, and each text is still encoded on its own.
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _check_number(name: str, value: Any, minimum: float = 0.0, strict: bool = True) -> float:
    """`value` as a float if it is a real number > minimum (>= minimum unless strict), else InvalidInputError."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (value > minimum if strict else value >= minimum):
        raise InvalidInputError(f"{name} must be a number {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def _check_int(name: str, value: Any, minimum: int, *, count: bool = False) -> int:
    """`value` if it is an int >= minimum (a `count` of requests or sessions: below 2**63, numpy sizes it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (count and value >= 2**63):
        raise InvalidInputError(f"{name} must be an integer >= {minimum}{' below 2**63' if count else ''}, got "
                                f"{value!r}")
    return value


def finite_arrivals(requests: list[Request], cause: str, fix: str = "pass a larger rate") -> list[Request]:
    """`requests` if every arrival time is finite, else InvalidInputError naming `cause` (the rates or gaps given)."""
    if not all(math.isfinite(request.ts) for request in requests):
        raise InvalidInputError(f"{cause} put arrival times past the range of floats (inf); {fix}")
    return requests


def _check_range(name: str, value: Any) -> tuple[int, int]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)) or not (
        0 <= value[0] <= value[1]
    ):
        raise InvalidInputError(f"{name} must be a (min, max) pair of integers with 0 <= min <= max, got {value!r}")
    return int(value[0]), int(value[1])


def parse_conversation(obj: Any) -> list[tuple[dict, dict]]:
    """(user, assistant) message pairs of one `{"conversation": [...]}` line; a trailing unanswered user turn is
    dropped (it has no reply to replay)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("conversation"), list):
        raise LineError('expected an object with a "conversation" list of {"role", "content"} messages')
    messages = obj["conversation"]
    for index, message in enumerate(messages):
        expected_role = "user" if index % 2 == 0 else "assistant"
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise LineError(f"message {index} must be an object with a string 'content'")
        if message.get("role") != expected_role:
            raise LineError(f"message {index} has role {message.get('role')!r}, expected {expected_role!r}")
    return list(zip(messages[0::2], messages[1::2], strict=False))


def conversation_requests(
    session_id: str,
    turns: list[tuple[list[int], list[int], int]],
    start_s: float,
    words_per_minute: float = WORDS_PER_MINUTE,
    max_context_tokens: int = MAX_CONTEXT_TOKENS,
    seconds_per_output_token: float = 0.0,
) -> list[Request]:
    """Requests of one session from its turns (user tokens, reply tokens, words in the user message).

    Turn 0 arrives at `start_s`; each later turn arrives after the previous reply was produced
    (`seconds_per_output_token` per reply token; 0 like the Marconi trace) plus the time to type the new user
    message at `words_per_minute`. The session stops at the first turn whose input + reply exceeds
    `max_context_tokens`.
    """
    requests: list[Request] = []
    history: list[int] = []
    ts = start_s
    for turn_id, (user_tokens, reply_tokens, user_words) in enumerate(turns):
        if len(history) + len(user_tokens) + len(reply_tokens) > max_context_tokens:
            break
        if turn_id > 0:
            ts += len(requests[-1].output_tokens) * seconds_per_output_token + user_words * 60.0 / words_per_minute
        input_tokens = np.asarray(history + user_tokens, dtype=np.int64)
        requests.append(Request(session_id, turn_id, ts, input_tokens, np.asarray(reply_tokens, dtype=np.int64)))
        history += user_tokens + reply_tokens
    return requests


def build_conversation_trace(
    conversations_path: str | Path,
    tokenizer_path: str | Path,
    sessions_per_second: float = 1.0,
    *,
    words_per_minute: float = WORDS_PER_MINUTE,
    max_context_tokens: int = MAX_CONTEXT_TOKENS,
    seconds_per_output_token: float = 0.0,
    min_turns: int = 1,
    max_sessions: int | None = None,
    on_error: str = "stop",
) -> list[Request]:
    """A multi-turn chat trace from `{"conversation": [{role, content}, ...]}` JSONL, sorted by arrival time.

    Session k (the k-th kept conversation, those with at least `min_turns` answered turns, at most `max_sessions`)
    starts at k / sessions_per_second seconds. The input of turn t is the tokens of all earlier messages plus the
    new user message; its output is the assistant's reply.
    """
    rate = _check_number("sessions_per_second", sessions_per_second)
    _check_number("words_per_minute", words_per_minute)
    _check_number("seconds_per_output_token", seconds_per_output_token, strict=False)
    _check_int("max_context_tokens", max_context_tokens, 1)
    _check_int("min_turns", min_turns, 0)
    if max_sessions is not None:
        _check_int("max_sessions", max_sessions, 1)
    encode = TextEncoder(tokenizer_path)

    conversations = [
        pairs for pairs in read_json_lines(conversations_path, parse_conversation, on_error) if len(pairs) >= min_turns
    ][:max_sessions]
    texts = [json.dumps(message) for pairs in conversations for pair in pairs for message in pair]
    token_lists = iter(encode(texts))
    requests: list[Request] = []
    for k, pairs in enumerate(conversations):
        # Words are counted as spaces, as the Marconi trace does (json.dumps leaves spaces as they are).
        turns = [(next(token_lists), next(token_lists), user["content"].count(" ")) for user, _ in pairs]
        requests += conversation_requests(
            str(k), turns, k / rate, words_per_minute, max_context_tokens, seconds_per_output_token
        )
    return finite_arrivals(sorted(requests, key=lambda r: r.ts), f"sessions_per_second={rate:g}, words_per_minute="
                           f"{words_per_minute:g} and seconds_per_output_token={seconds_per_output_token:g}",
                           "pass a larger rate or typing speed, or a shorter reply time")


# --- shared-prefix workloads: many short requests behind a few long, shared prefixes -------------------------------


def popularity_weights(num_items: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Zipf-like probabilities: item of (random) rank r gets weight r**-skew; skew 0 is uniform."""
    ranks = rng.permutation(num_items) + 1
    weights = ranks.astype(np.float64) ** -skew
    return weights / weights.sum()


def poisson_arrivals(num_requests: int, requests_per_second: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of a Poisson process at `requests_per_second`, the first at 0."""
    gaps = rng.exponential(1.0 / requests_per_second, size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num_requests else np.zeros(0)


def random_tokens(rng: np.random.Generator, length_range: tuple[int, int], vocab_size: int) -> np.ndarray:
    """Uniform random token ids, a length drawn uniformly from the inclusive `length_range`."""
    return rng.integers(0, vocab_size, size=rng.integers(length_range[0], length_range[1] + 1), dtype=np.int64)


# A query for prefix i: (rng, i) -> (query tokens appended to the prefix, output tokens).
QuerySampler = Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]


def shared_prefix_requests(
    prefixes: list[np.ndarray],
    sample_query: QuerySampler,
    num_requests: int,
    requests_per_second: float,
    popularity_skew: float,
    seed: int,
) -> list[Request]:
    """One-turn requests `prefix + query`: the prefix drawn with skewed popularity, arrivals Poisson."""
    rng = np.random.default_rng(seed)
    choices = rng.choice(len(prefixes), size=num_requests, p=popularity_weights(len(prefixes), popularity_skew, rng))
    arrivals = poisson_arrivals(num_requests, requests_per_second, rng)
    requests = []
    for index, (prefix_index, ts) in enumerate(zip(choices.tolist(), arrivals.tolist(), strict=True)):
        query, output = sample_query(rng, prefix_index)
        requests.append(
            Request(f"p{prefix_index}-r{index}", 0, ts, np.concatenate([prefixes[prefix_index], query]), output)
        )
    return finite_arrivals(requests, f"requests_per_second={requests_per_second:g}")


def _html_text(lines: list[str]) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", "".join(lines))).strip()


def parse_quality_article(obj: Any) -> tuple[str, list[tuple[str, str]]]:
    """(document text, [(question with its options, gold answer text)]) of one QuALITY line."""
    if not isinstance(obj, dict) or not isinstance(obj.get("article"), list):
        raise LineError('expected a QuALITY object with an "article" list and question<i>, question<i>option<k> fields')
    questions = []
    for i in itertools.takewhile(lambda i: f"question{i}" in obj, itertools.count(1)):
        options = [
            obj[f"question{i}option{k}"]
            for k in itertools.takewhile(lambda k, i=i: f"question{i}option{k}" in obj, itertools.count(1))
        ]
        gold = obj.get(f"question{i}_gold_label")
        if isinstance(gold, bool) or not isinstance(gold, int) or not 1 <= gold <= len(options):
            raise LineError(f"question{i}_gold_label must be an option number in [1, {len(options)}], got {gold!r}")
        listed = "\n".join(f"{k}. {option}" for k, option in enumerate(options, start=1))
        questions.append((f"\n\nQuestion: {obj[f'question{i}']}\n{listed}\nAnswer:", f" {options[gold - 1]}"))
    if not questions:
        raise LineError("the article has no question1 field")
    return _html_text(obj["article"]), questions


def parse_system_prompt(obj: Any) -> tuple[str, str]:
    """(path, prompt text) of one `{"path": ..., "text": ...}` line; the path is optional ("")."""
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or not obj["text"]:
        raise LineError('expected an object with a non-empty "text" (the system prompt)')
    if not isinstance(obj.get("path", ""), str):
        raise LineError(f"path must be a string, got {obj['path']!r}")
    return obj.get("path", ""), obj["text"]


def _ids(encode: TextEncoder, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.int64) for ids in encode(texts)]


def document_workload(path: Path, encode: TextEncoder, on_error: str) -> tuple[list[np.ndarray], QuerySampler]:
    """Documents as prefixes; a query is one of the document's questions (uniform), its output the gold answer."""
    articles = list(read_json_lines(path, parse_quality_article, on_error))
    questions = [
        list(zip(_ids(encode, [q for q, _ in qa]), _ids(encode, [a for _, a in qa]), strict=True)) for _, qa in articles
    ]

    def sample_query(rng: np.random.Generator, i: int) -> tuple[np.ndarray, np.ndarray]:
        return questions[i][rng.integers(len(questions[i]))]

    return _ids(encode, [text for text, _ in articles]), sample_query


def system_prompt_workload(
    path: Path,
    encode: TextEncoder,
    on_error: str,
    query_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    path_prefix: str = "",
) -> tuple[list[np.ndarray], QuerySampler]:
    """System prompts (those whose path starts with `path_prefix`, e.g. one product's versions) as prefixes; a
    query and its output are random tokens (no real user queries ship with the prompts)."""
    prompts = [
        text for name, text in read_json_lines(path, parse_system_prompt, on_error) if name.startswith(path_prefix)
    ]
    if path_prefix and not prompts:
        raise InvalidInputError(f"path_prefix {path_prefix!r} matches no prompt path in {str(path)!r}")
    prompts = _ids(encode, prompts)

    def sample_query(rng: np.random.Generator, i: int) -> tuple[np.ndarray, np.ndarray]:
        return random_tokens(rng, query_tokens, encode.vocab_size), random_tokens(rng, output_tokens, encode.vocab_size)

    return prompts, sample_query


def detect_shared_prefix_kind(path: Path) -> str:
    """'document' (QuALITY lines: article + questions) or 'system-prompt' (lines with a "text")."""
    with path.open("rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    first = json.loads(line)
                except (ValueError, RecursionError) as err:
                    raise TraceFormatError(f"{path}:{line_number}: {err}") from None
                if isinstance(first, dict) and "article" in first:
                    return "document"
                if isinstance(first, dict) and "text" in first:
                    return "system-prompt"
                break
    raise TraceFormatError(
        f"{path}: the first line is neither a QuALITY article (article, question1, ...) nor a system prompt (text)"
    )


def build_shared_prefix_trace(
    input_path: str | Path,
    tokenizer_path: str | Path,
    *,
    num_requests: int = 1000,
    requests_per_second: float = 1.0,
    popularity_skew: float = 1.0,
    query_tokens: tuple[int, int] = (16, 128),
    output_tokens: tuple[int, int] = (32, 256),
    seed: int = 0,
    path_prefix: str = "",
    on_error: str = "stop",
) -> list[Request]:
    """A one-turn shared-prefix trace; the workload is detected from `input_path`:

    - QuALITY JSONL (long-document QA): a request is one document + one of its questions with the options; the
      output is the gold answer;
    - system prompts JSONL (`{"path": ..., "text": ...}`): a request is one system prompt (of those whose path
      starts with `path_prefix`) + a random user query of `query_tokens` (min, max) tokens; the output is
      `output_tokens` random tokens.

    Prefixes are drawn with Zipf popularity (`popularity_skew`; 0 = uniform), arrivals are Poisson at
    `requests_per_second`, and `seed` fixes everything.
    """
    _check_number("requests_per_second", requests_per_second)
    _check_number("popularity_skew", popularity_skew, strict=False)
    _check_int("num_requests", num_requests, 1, count=True)
    _check_int("seed", seed, 0)
    if not isinstance(path_prefix, str):
        raise InvalidInputError(f"path_prefix must be a string, got {path_prefix!r}")
    query_tokens, output_tokens = (
        _check_range("query_tokens", query_tokens),
        _check_range("output_tokens", output_tokens),
    )
    encode = TextEncoder(tokenizer_path)
    path = existing_file(input_path, on_error)
    if detect_shared_prefix_kind(path) == "document":
        if path_prefix:
            raise InvalidInputError(f"path_prefix selects system prompts; {str(path)!r} holds QuALITY documents")
        prefixes, sample_query = document_workload(path, encode, on_error)
    else:
        prefixes, sample_query = system_prompt_workload(
            path, encode, on_error, query_tokens, output_tokens, path_prefix
        )
    if not prefixes:
        raise TraceFormatError(f"{path}: no usable line (every line was skipped)")
    return shared_prefix_requests(prefixes, sample_query, num_requests, requests_per_second, popularity_skew, seed)


# --- a small synthetic trace that needs no files -------------------------------------------------------------------

BUILTIN_VOCAB_SIZE = 50_277  # GPT-NeoX's, so builtin token ids are valid for the tokenizer the traces use


def builtin_trace(seed: int = 0, num_sessions: int = 24, num_prompt_requests: int = 48) -> list[Request]:
    """A small deterministic synthetic trace mixing multi-turn chats and shared system prompts (no files needed).

    Four system prompts: three versions of one product prompt that diverge at 600 and 1200 tokens and an unrelated
    one. Chat sessions (2-6 turns, one every 2 s) open with a prompt; one-turn requests (1/s) ask a prompt a short
    question. Prompts are picked with Zipf(1) popularity.
    """
    _check_int("seed", seed, 0)
    _check_int("num_sessions", num_sessions, 0, count=True)
    _check_int("num_prompt_requests", num_prompt_requests, 0, count=True)
    rng = np.random.default_rng(seed)
    version_1 = rng.integers(0, BUILTIN_VOCAB_SIZE, size=1600, dtype=np.int64)
    version_2 = np.concatenate([version_1[:1200], rng.integers(0, BUILTIN_VOCAB_SIZE, size=500, dtype=np.int64)])
    version_3 = np.concatenate([version_1[:600], rng.integers(0, BUILTIN_VOCAB_SIZE, size=900, dtype=np.int64)])
    prompts = [version_1, version_2, version_3, rng.integers(0, BUILTIN_VOCAB_SIZE, size=900, dtype=np.int64)]
    popularity = popularity_weights(len(prompts), 1.0, rng)

    requests: list[Request] = []
    for k in range(num_sessions):
        turns = []
        for turn in range(int(rng.integers(2, 7))):
            user = random_tokens(rng, (20, 120), BUILTIN_VOCAB_SIZE)
            if turn == 0:
                user = np.concatenate([prompts[rng.choice(len(prompts), p=popularity)], user])
            reply = random_tokens(rng, (40, 240), BUILTIN_VOCAB_SIZE)
            turns.append((user.tolist(), reply.tolist(), len(user) * 3 // 4))  # ~0.75 words per token
        requests += conversation_requests(f"chat-{k}", turns, start_s=2.0 * k)

    def sample_query(query_rng: np.random.Generator, i: int) -> tuple[np.ndarray, np.ndarray]:
        return random_tokens(query_rng, (16, 64), BUILTIN_VOCAB_SIZE), random_tokens(
            query_rng, (32, 128), BUILTIN_VOCAB_SIZE
        )

    if num_prompt_requests:
        requests += shared_prefix_requests(prompts, sample_query, num_prompt_requests, 1.0, 1.0, seed + 1)
    return sorted(requests, key=lambda r: r.ts)
