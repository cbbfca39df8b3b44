"""The generation options `prefixlab run` decodes with (GREEDY) and those under which a padded sibling batch would
generate other tokens than each prompt alone (`prompt_reading_options`, and `eos_reading_options` for a prompt's
stop token ids: such prompts are served one by one)."""

from __future__ import annotations

_PROMPT_READING = {  # generation options whose logits processors read a row's tokens or length (its padding too)
    # assisted decoding from the generation config (prompt lookup reads the prompt; transformers runs it on one row:
    # a batch raised "assisted generate is only supported for batch_size = 1")
    "prompt_lookup_num_tokens": lambda v: v is not None, "assistant_early_exit": lambda v: v is not None,
    "use_mtp": bool,
    "watermarking_config": lambda v: v is not None and _watermark_reads_before_last(v),
    "repetition_penalty": lambda v: v not in (None, 1.0), "no_repeat_ngram_size": bool, "min_length": bool,
    # a decoder-only model's "encoder" ids are the input ids generate gets, a padded row's pads included: the pad id
    # boosted (encoder_repetition_penalty) or its n-grams banned (encoder_no_repeat_ngram_size) in a batch only
    "encoder_repetition_penalty": lambda v: v not in (None, 1.0), "encoder_no_repeat_ngram_size": bool,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,  # (forced at the batch's last step, not each row's)
    # a sequence of several tokens is matched against each row's last tokens, pads in a row with few own tokens
    # (one token reads nothing before it: a plain ban or bias, the same in a batch)
    "bad_words_ids": lambda v: any(_several(word) for word in v or ()),
    "sequence_bias": lambda v: any(_several(tokens) for tokens in _biased_sequences(v)),
}


def _watermark_reads_before_last(config) -> bool:
    """Whether a watermark reads a row's tokens before its last (pads in a padded batch) or its length: transformers'
    "lefthash" hashes the last token only, "selfhash" the last context_width - 1 and the candidate, but both add no
    bias while the input is shorter than context_width (a padded row is as long as the batch); SynthID hashes its
    last ngram_len - 1 (and a scheme not known here is taken to read them)."""
    scheme = getattr(config, "seeding_scheme", None)
    return scheme not in ("lefthash", "selfhash") or getattr(config, "context_width", 1) > 1


def _several(tokens) -> bool:
    return isinstance(tokens, list | tuple) and len(tokens) > 1  # (malformed values are generate's to refuse)


def _biased_sequences(bias) -> list:
    """The token sequences of a `sequence_bias`: a dict's keys, or the first items of [[tokens], bias] pairs (the
    form a generation_config.json holds)."""
    if isinstance(bias, dict):
        return list(bias)
    return [pair[0] for pair in bias or () if isinstance(pair, list | tuple) and pair]


# What `prefixlab run` decodes with, whatever the model's generation config says (its num_beams / num_return_sequences
# would make a beam search of it, or return more rows than one per prompt; its cache_implementation, e.g. "static"
# saved for torch.compile, would make generate refuse the store's cache passed beside it; a "use_cache": false left
# by training would feed every sequence whole at each step, which Zamba2 / Nemotron-H refuse with a cache;
# return_dict_in_generate would return an output object where run reads the tensor of token ids).
GREEDY = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "cache_implementation": None,
          "use_cache": True, "return_dict_in_generate": False}


def prompt_reading_options(model) -> list[str]:
    """The options of `model.generation_config` under which a padded sibling batch would generate other tokens than
    each prompt alone (`name=value`); empty when it may batch."""
    config = getattr(model, "generation_config", None)
    return [f"{name}={getattr(config, name)!r}" for name, set_ in _PROMPT_READING.items()
            if config is not None and set_(getattr(config, name, None))]


def eos_reading_options(model, stop_token_ids) -> list[str]:
    """The options of `model.generation_config` whose logits processors read generate's EOS list, which a prompt's
    `stop_token_ids` join when it is served alone (fleet/stops.generate_options) but not in a sibling batch (there
    each row's are a stopping criterion, fleet/stops.row_stops): min_new_tokens suppresses them in the first tokens,
    bad_words_ids lifts a one-token ban on them. Empty when the prompt may batch."""
    from prefixlab.fleet.stops import eos_ids

    config = getattr(model, "generation_config", None)
    extra = set(stop_token_ids) - set(eos_ids(model))
    if config is None or not extra:
        return []
    unbanned = [word for word in getattr(config, "bad_words_ids", None) or ()
                if isinstance(word, list | tuple) and len(word) == 1 and word[0] in extra]
    return [f"{name}={value!r}" for name, value in (("min_new_tokens", getattr(config, "min_new_tokens", None)),
                                                   ("bad_words_ids", unbanned)) if value]
