"""The tokenizer of `prefixlab run`: text and chat prompts to token ids, output ids back to text.

Two kinds, both read from local files only:
- a `tokenizers` JSON file (`--tokenizer tokenizer.json`): `text` is encoded without special tokens (as the trace
  builders do); no chat template, so `messages` prompts are refused;
- a transformers tokenizer folder (`--tokenizer FOLDER`, or the `--model` folder itself when it holds one): `text`
  is encoded as `tokenizer(text)` encodes it (its special tokens, e.g. a BOS, included), and `messages` through its
  chat template with the generation prompt appended, as `apply_chat_template(messages, add_generation_prompt=True)`.

Stop strings (a prompt line's `stop`) are matched by transformers' `generate(stop_strings=..., tokenizer=...)` with
`stopping_tokenizer`: the folder's tokenizer, or a `PreTrainedTokenizerFast` over the tokenizers JSON file.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from prefixlab.errors import InvalidInputError

# the files of a transformers tokenizer folder that decide its ids and chat template (the digest of a run's outputs)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


class PromptTokenizer:
    """`encode(text)`, `encode_chat(messages)` and `decode(ids)` over one tokenizer (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            if not any((self.path / name).is_file() for name in _TOKENIZER_FILES[:1] + _TOKENIZER_FILES[6:]):
                raise InvalidInputError(f"--tokenizer {str(path)!r}: the folder holds no tokenizer files "
                                        "(tokenizer.json, vocab.json + merges.txt or tokenizer.model)")
            from transformers import AutoTokenizer

            try:
                self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            # (tokenizers raises a bare Exception on a tokenizer.json it cannot read, e.g. one from a newer version)
            except Exception as err:
                raise InvalidInputError(f"--tokenizer {str(path)!r}: not a transformers tokenizer folder "
                                        f"({' '.join(str(err).split())})") from None
            self.fast = None
        else:
            from prefixlab.sim.build import TextEncoder

            self.hf, self.fast = None, TextEncoder(self.path).tokenizer
        self._stopping, self._stop_checked = None, {}

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf(text)["input_ids"])
        return self.fast.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` rendered by the chat template, ending with the generation prompt (ValueError where
        there is no chat template: a malformed line, reported with its file:line)."""
        if self.hf is None:
            raise ValueError(f"'messages' need a chat template: {str(self.path)!r} is a tokenizers JSON file; pass "
                             "--tokenizer with a transformers tokenizer folder (or use text / input_ids)")
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"'messages' need a chat template and the tokenizer in {str(self.path)!r} has none "
                             "(chat_template in tokenizer_config.json or chat_template.jinja); use text / input_ids")
        from jinja2 import TemplateError

        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as err:  # templates refuse chats with raise_exception (e.g. roles that do not alternate)
            raise ValueError(f"the chat template of {str(self.path)!r} refused these messages: {err}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=True)
        return self.fast.decode(ids)

    def stopping_tokenizer(self):
        """The transformers tokenizer `generate(stop_strings=..., tokenizer=...)` matches stop strings with."""
        if self.hf is not None:
            return self.hf
        if self._stopping is None:
            from transformers import PreTrainedTokenizerFast

            self._stopping = PreTrainedTokenizerFast(tokenizer_object=self.fast)
        return self._stopping

    def check_stop_strings(self, strings: tuple[str, ...]) -> None:
        """ValueError (a malformed line) where transformers cannot match `strings` with this tokenizer: generate would
        raise it on the prompt (a character no token has; a vocabulary whose token strings it cannot recover). Builds
        generate's StopStringCriteria once per set of strings (transformers keeps the last 8 for generate)."""
        if strings not in self._stop_checked:
            from transformers.generation.stopping_criteria import StopStringCriteria

            try:
                StopStringCriteria(self.stopping_tokenizer(), list(strings))
                self._stop_checked[strings] = None
            except (ValueError, KeyError, IndexError) as err:
                self._stop_checked[strings] = f"transformers cannot match 'stop' {list(strings)!r} with the " \
                    f"tokenizer {str(self.path)!r} ({' '.join(str(err).split())}); use stop_token_ids"
        if self._stop_checked[strings] is not None:
            raise ValueError(self._stop_checked[strings])

    def digest(self) -> bytes:
        """The bytes of the files that decide what it encodes and decodes (a run's outputs record them)."""
        files = [self.path / name for name in _TOKENIZER_FILES] if self.path.is_dir() else [self.path]
        digest = hashlib.sha256()
        for file in files:
            if file.is_file():
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return digest.digest()


def prompt_tokenizer(tokenizer: str | None, model: str) -> PromptTokenizer | None:
    """`--tokenizer` if given, else the `--model` folder's own tokenizer where it holds one, else None."""
    if tokenizer is not None:
        return PromptTokenizer(tokenizer)
    folder = Path(model)
    if not (folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))):
        return None
    try:
        return PromptTokenizer(folder)
    except InvalidInputError as error:  # input_ids prompts still run: say why text ones will not
        print(f"prefixlab: note: the model folder's tokenizer is not used ({error})", file=sys.stderr)
        return None
