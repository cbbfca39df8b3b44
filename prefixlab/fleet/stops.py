"""Stop conditions of `prefixlab run` prompts and why each generation ended.

A prompt line's `stop_token_ids` and `stop` (prefixlab.fleet.prompts) become the options transformers' `generate`
takes for them, so a prompt's output is the uncached model's `generate` with those options, token for token:
- `stop_token_ids`: `eos_token_id=[the model's EOS ids..., *stop_token_ids]` (generate stops after the first token of
  that list; the model's own EOS still stops it);
- `stop`: `stop_strings=[...], tokenizer=...` (StopStringCriteria: generation stops after the token that completes
  a stop string; a string may begin in the prompt, since transformers matches it over the whole sequence).
The stop token, or the token completing a stop string, is the last token of the output (and of its `text`), as
transformers returns it. Sibling batches (fleet/siblings.py) take stop token ids per row (`RowStops`); prompts with
stop strings are served one by one (a padded row would show the matcher its padding).

Every output record says why its generation ended (`finish_reason`): "stop" (a stop token id or a stop string),
"eos" (the model's EOS, its generation config's `eos_token_id`) or "length" (max_new_tokens reached).
"""

from __future__ import annotations

from collections.abc import Sequence


def eos_ids(model) -> list[int]:
    """The model's EOS ids (its generation config's `eos_token_id`), in order."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def check_model_stop_strings(model, model_arg: str) -> None:
    """InvalidInputError where the model's generation config names stop strings: generate would need a tokenizer for
    every prompt, stop a sibling batch's rows on their padding and report "length"; run takes them per line."""
    strings = getattr(model.generation_config, "stop_strings", None)
    if strings:
        from prefixlab.errors import InvalidInputError

        raise InvalidInputError(
            f"--model {model_arg!r}: its generation_config.json sets stop_strings {strings!r}; prefixlab run takes "
            "stop strings per prompt line (\"stop\": [...]): remove them from generation_config.json and add them "
            "to the lines that should stop there")


def generate_options(model, stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                     tokenizer=None) -> dict:
    """The keyword arguments of `generate` for these stop conditions ({} without any). `tokenizer`: the transformers
    tokenizer stop strings are matched with (PromptTokenizer.stopping_tokenizer)."""
    options = {}
    if stop_token_ids:
        eos = eos_ids(model)
        options["eos_token_id"] = eos + [t for t in stop_token_ids if t not in eos]
    if stop_strings:
        if tokenizer is None:
            from prefixlab.errors import InvalidInputError

            raise InvalidInputError("stop strings need the tokenizer to match them (generate's tokenizer=)")
        options |= {"stop_strings": list(stop_strings), "tokenizer": tokenizer}
    return options


def ends_on_stop_string(sequence, stop_strings: Sequence[str], tokenizer) -> bool:
    """Whether the token ids `sequence` (prompt and output, 1-D) end by completing one of `stop_strings`, as
    generate's StopStringCriteria decides after each token."""
    import torch
    from transformers.generation.stopping_criteria import StopStringCriteria

    ids = torch.as_tensor(sequence, dtype=torch.long).reshape(1, -1)
    return bool(StopStringCriteria(tokenizer, list(stop_strings))(ids, None)[0])


def finish_reason(output_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int], stop_token_ids=(),
                  stop_string_matched=None) -> str:
    """Why a generation that returned `output_ids` ended: "stop", "eos" or "length" (see the module docstring).
    `stop_string_matched()`: whether the sequence ends on a stop string (asked only where that decides it)."""
    last = output_ids[-1] if output_ids else None
    if last in stop_token_ids:
        return "stop"
    if last in eos:
        return "eos"
    if stop_string_matched is not None and (len(output_ids) < max_new_tokens or stop_string_matched()):
        return "stop"  # (generate stopped early with no stop id or EOS last: only a stop string does that)
    return "length"


def row_stops(max_new_tokens: Sequence[int], stop_token_ids: Sequence[Sequence[int]], prompt_width: int):
    """A StoppingCriteria for a sibling batch: a row is done once it has its own max_new_tokens or ends on one of
    its own stop token ids, so the batch ends when every row is (generate pads a done row's later tokens; each row
    is then cut as generate of it alone returns it, fleet/siblings.keep_row). `prompt_width`: the batch's input
    columns."""
    import torch
    from transformers import StoppingCriteria

    class RowStops(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            generated = input_ids.shape[1] - prompt_width
            last = input_ids[:, -1].tolist()
            return torch.tensor([generated >= n or last[b] in stop_token_ids[b] for b, n in enumerate(max_new_tokens)],
                                dtype=torch.bool, device=input_ids.device)

    return RowStops()
