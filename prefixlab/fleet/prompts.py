"""The prompt file of `prefixlab run`: one JSON object per line.

    {"id": "q1", "text": "Summarize ...", "max_new_tokens": 32}
    {"id": "c1", "messages": [{"role": "system", "content": "You are ..."}, {"role": "user", "content": "Hi"}]}
    {"id": 7, "input_ids": [101, 2023, 318]}

    {"id": "r1", "input_ids": [101, 2023], "temperature": 0.8, "top_p": 0.95, "seed": 7}
    {"id": "s1", "text": "List three colours:", "stop": ["\\n\\n", "4."], "stop_token_ids": [13]}

`id` (string or int, unique) and exactly one of `text` (needs a tokenizer), `messages` (a chat: needs a tokenizer
with a chat template; fleet/tokenizer.py) or `input_ids` are required; `max_new_tokens` is optional (default: the
command's --max-new-tokens). Generation is greedy unless `temperature` > 0: then sampled, with `top_p` / `top_k` if
given (others as the model's generation config says) and the random generator seeded with `seed` (default: one
derived from the id), so a prompt's output is the same whichever process serves it, in whatever order, cached or
not, and on a rerun.

Stop conditions (fleet/stops.py): `stop_token_ids` (a list of token ids: generation also stops after any of them, as
`generate(eos_token_id=[the model's EOS ids..., *stop_token_ids])` stops) and `stop` (a string or a list of them:
`generate(stop_strings=..., tokenizer=...)`, so it needs a tokenizer). The stop token, or the token that completes a
stop string, is kept in the output, as transformers keeps it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefixlab.errors import InvalidInputError
from prefixlab.fleet.tokenizer import PromptTokenizer

ON_ERROR_CHOICES = ("stop", "skip")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")
STOP_KEYS = ("stop_token_ids", "stop")
KEYS = {"id", "text", "messages", "input_ids", "max_new_tokens", *SAMPLING_KEYS, *STOP_KEYS}
PROMPT_KEYS = ("text", "messages", "input_ids")


@dataclass(slots=True)
class Prompt:
    """One line of the prompt file: its position in the file (`index`, 0-based), id and token ids."""

    index: int
    id: str | int
    tokens: np.ndarray
    max_new_tokens: int
    sampling: tuple[tuple[str, float | int], ...] = ()  # sorted (option, value) pairs; () = greedy
    stop_token_ids: tuple[int, ...] = ()  # sorted, each once
    stop_strings: tuple[str, ...] = ()  # sorted, each once (the line's `stop`)

    @property
    def fingerprint(self) -> str:
        """A short hash of what the output depends on besides the model: the token ids, max_new_tokens, the
        sampling options and the stop conditions."""
        digest = hashlib.sha256(np.asarray(self.tokens, dtype=np.int64).tobytes())
        digest.update(str(self.max_new_tokens).encode())
        if self.sampling:  # (a greedy prompt's fingerprint stays what earlier versions wrote)
            digest.update(json.dumps(self.sampling).encode())
        if self.stop_token_ids or self.stop_strings:  # (so does one without stop conditions)
            digest.update(json.dumps({"stop_token_ids": self.stop_token_ids, "stop": self.stop_strings}).encode())
        return digest.hexdigest()[:16]


def _parse(obj: object, tokenizer: PromptTokenizer | None, default_new_tokens: int) -> tuple:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = set(obj) - KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (allowed: {', '.join(sorted(KEYS))})")
    prompt_id = obj.get("id")
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int):
        raise ValueError("'id' must be a string or an int")
    if sum(key in obj for key in PROMPT_KEYS) != 1:
        raise ValueError("give exactly one of 'text', 'messages' and 'input_ids'")
    if "text" in obj or "messages" in obj:
        if tokenizer is None:
            kind = "text" if "text" in obj else "messages"
            raise ValueError(f"a '{kind}' prompt needs a tokenizer: pass --tokenizer (a tokenizer.json, or a "
                             "transformers tokenizer folder for messages) or use input_ids")
        if "text" in obj:
            if not isinstance(obj["text"], str):
                raise ValueError("'text' must be a string")
            ids = tokenizer.encode(obj["text"])
        else:
            ids = tokenizer.encode_chat(_messages(obj["messages"]))
    else:
        ids = obj["input_ids"]
        if not _token_ids(ids):
            raise ValueError("'input_ids' must be a list of token ids (ints in [0, 2**63))")
    if not ids:
        raise ValueError("the prompt is empty")
    new_tokens = obj.get("max_new_tokens", default_new_tokens)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError("'max_new_tokens' must be a positive int")
    return prompt_id, np.asarray(ids, dtype=np.int64), new_tokens, _sampling(obj, prompt_id), *_stops(obj, tokenizer)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63
                                           for t in value)


def _stops(obj: dict, tokenizer: PromptTokenizer | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The stop conditions of a prompt line: (stop token ids, stop strings), each sorted and once; () where none."""
    ids = obj.get("stop_token_ids", [])
    if not _token_ids(ids):
        raise ValueError("'stop_token_ids' must be a list of token ids (ints in [0, 2**63))")
    strings = obj.get("stop", [])
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError("'stop' must be a string or a list of strings")
    if not all(strings):
        raise ValueError("'stop' strings must not be empty (an empty string would stop at once)")
    strings = tuple(sorted(set(strings)))
    if strings:
        if tokenizer is None:
            raise ValueError("'stop' strings need a tokenizer (transformers matches them against its vocabulary): "
                             "pass --tokenizer (or a --model folder with its tokenizer), or use stop_token_ids")
        tokenizer.check_stop_strings(strings)
    return tuple(sorted(set(ids))), strings


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def _sampling(obj: dict, prompt_id: str | int) -> tuple:
    """The sampling options of a prompt line, sorted, with its seed; () for greedy (no or a zero temperature)."""
    temperature = obj.get("temperature", 0)
    if not _number(temperature) or temperature < 0:
        raise ValueError("'temperature' must be a number >= 0 (0: greedy)")
    given = [key for key in SAMPLING_KEYS[1:] if key in obj]
    if 0 < temperature < np.finfo(np.float32).tiny:  # (logits / temperature overflow float32 to inf: NaN probabilities)
        raise ValueError(f"'temperature' {temperature!r} is below float32's smallest normal number; use 0 for greedy")
    if temperature == 0:
        if given:
            raise ValueError(f"{', '.join(repr(k) for k in given)} apply to sampling: give 'temperature' > 0")
        return ()
    options = {"temperature": float(temperature)}
    if "top_p" in obj:
        if not _number(obj["top_p"]) or not 0 < obj["top_p"] <= 1:
            raise ValueError("'top_p' must be a number in (0, 1]")
        options["top_p"] = float(obj["top_p"])
    for key, low in (("top_k", 0), ("seed", 0)):
        if key in obj:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
                raise ValueError(f"'{key}' must be an int in [{low}, 2**63)")
            options[key] = value
    # (a seed from the id: the same on every process and rerun, different for each prompt)
    options.setdefault("seed", int(hashlib.sha256(json.dumps(prompt_id).encode()).hexdigest()[:15], 16))
    return tuple(sorted(options.items()))


def _messages(messages: object) -> list[dict]:
    """A chat as its template takes it: a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects (strings)")
    return messages


def read_prompts(path: str | Path, tokenizer: PromptTokenizer | None = None, *, max_new_tokens: int = 16,
                 on_error: str = "stop", vocab_size: int | None = None,
                 max_positions: int | None = None) -> list[Prompt]:
    """The prompts of a JSONL file. A malformed line raises InvalidInputError naming file:line (`on_error="stop"`)
    or is reported on stderr and left out (`"skip"`); duplicate ids always raise. With `vocab_size` a token id
    outside the vocabulary is a malformed line, with `max_positions` (the model's context) so is a prompt whose
    tokens plus max_new_tokens exceed it (as serving engines refuse what the model was not built for)."""
    if on_error not in ON_ERROR_CHOICES:
        raise InvalidInputError(f"--on-error {on_error!r}: use one of {', '.join(ON_ERROR_CHOICES)}")
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path}: {'a folder, not a' if path.is_dir() else 'no such'} prompt file")
    prompts: list[Prompt] = []
    first_line: dict[str | int, int] = {}
    with open(path, "rb") as lines:  # bytes: json.loads decodes them (a BOM too), so bad UTF-8 is a bad line
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompt_id, tokens, new_tokens, sampling, stop_ids, stop_strings = _parse(json.loads(line), tokenizer,
                                                                                         max_new_tokens)
                if vocab_size is not None and tokens.max() >= vocab_size:
                    raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary ({vocab_size})")
                if vocab_size is not None and stop_ids and stop_ids[-1] >= vocab_size:
                    raise ValueError(f"stop token id {stop_ids[-1]} is outside the model's vocabulary ({vocab_size})")
                if max_positions is not None and len(tokens) + new_tokens > max_positions:
                    raise ValueError(f"{len(tokens)} prompt tokens + {new_tokens} new tokens exceed the model's "
                                     f"context of {max_positions} (max_position_embeddings): shorten the prompt or "
                                     "lower max_new_tokens")
            except (ValueError, TypeError, RecursionError) as err:  # (JSONDecodeError: a ValueError; nesting)
                message = f"{path}:{number}: {err}"
                if on_error == "stop":
                    raise InvalidInputError(message + " (fix the line, or pass --on-error skip)") from None
                print(f"prefixlab: skipped {message}", file=sys.stderr)
                continue
            if prompt_id in first_line:
                raise InvalidInputError(f"{path}:{number}: duplicate id {prompt_id!r} (first on line "
                                        f"{first_line[prompt_id]}); ids must be unique")
            first_line[prompt_id] = number
            prompts.append(Prompt(len(prompts), prompt_id, tokens, new_tokens, sampling, stop_ids, stop_strings))
    if not prompts:
        raise InvalidInputError(f"{path}: no prompts")
    return prompts
