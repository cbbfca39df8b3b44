"""Trace builders from raw data: multi-turn conversations, shared-document and system-prompt workloads.

The conversation builder follows the construction of the Marconi paper's LMSys trace: every message is
JSON-encoded on its own (``json.dumps({"role": ..., "content": ...})``, ASCII-escaped) and tokenised on its own,
so turn t's input is exactly turn t-1's input + output tokens followed by the new user message's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixlab.errors import InvalidInputError
from prefixlab.sim.formats import LineError, read_json_lines
from prefixlab.sim.trace import Request

WORDS_PER_MINUTE = 90.0  # the typing speed the Marconi trace assumes between turns
MAX_CONTEXT_TOKENS = 8192  # a session stops at the first turn whose input + output would exceed this

Encoder = Callable[[list[str]], list[list[int]]]


def load_encoder(tokenizer_path: str | Path) -> Encoder:
    """A batch encoder (texts -> token-id lists) from a `tokenizers` JSON file; no special tokens are added."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    if not path.is_file():
        raise InvalidInputError(f"tokenizer_path {str(path)!r} does not exist; pass a tokenizers JSON file")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on unreadable files
        raise InvalidInputError(f"tokenizer_path {str(path)!r} is not a tokenizers JSON file ({err})") from None
    return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInputError(f"{name} must be a positive number, got {value!r}")
    return float(value)


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
    rate = _positive("sessions_per_second", sessions_per_second)
    _positive("words_per_minute", words_per_minute)
    if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int) or max_context_tokens < 1:
        raise InvalidInputError(f"max_context_tokens must be a positive integer, got {max_context_tokens!r}")
    if not isinstance(seconds_per_output_token, (int, float)) or seconds_per_output_token < 0:
        raise InvalidInputError(f"seconds_per_output_token must be >= 0, got {seconds_per_output_token!r}")
    if max_sessions is not None and (not isinstance(max_sessions, int) or max_sessions < 1):
        raise InvalidInputError(f"max_sessions must be a positive integer or None, got {max_sessions!r}")
    encode = load_encoder(tokenizer_path)

    conversations = [
        pairs for pairs in read_json_lines(conversations_path, parse_conversation, on_error) if len(pairs) >= min_turns
    ][:max_sessions]
    # One batch call for every message: the tokenizer parallelises it and each message is encoded on its own.
    texts = [json.dumps(message) for pairs in conversations for pair in pairs for message in pair]
    token_lists = iter(encode(texts))
    requests: list[Request] = []
    for k, pairs in enumerate(conversations):
        turns = [(next(token_lists), next(token_lists), user["content"].count(" ")) for user, _ in pairs]
        requests += conversation_requests(
            str(k), turns, k / rate, words_per_minute, max_context_tokens, seconds_per_output_token
        )
    return sorted(requests, key=lambda r: r.ts)
