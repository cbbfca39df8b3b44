"""One process's share of a batch: the model, its PrefixStore, and the loop over scheduled steps."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from prefixlab.errors import PrefixlabError
from prefixlab.fleet.prompts import Prompt


@dataclass
class ProcessStats:
    """What one process did in this run. `prefilled_tokens` counts every token its model computed in prefill
    (prime steps included, and the padding of batched siblings): the work routing balances and scheduling saves.
    `kv_bytes_read`: attention KV the decode steps read (a Hydragen batch reads its shared prefix once per step);
    `kv_bytes_held_peak`: the most attention KV one generate call held (a prompt alone, or a Hydragen batch).
    `prefill_seconds`: wall time of the prefills: from each generate() call (a Hydragen batch: from its rows'
    prefills) to its first token's logits, plus the primes."""

    process: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prime_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    batches: int = 0
    batched_requests: int = 0
    padding_tokens: int = 0
    kv_bytes_read: int = 0
    kv_bytes_held_peak: int = 0
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # why each request reused what it did (cache/explain.py)
    finish_reasons: dict[str, int] = field(default_factory=dict)  # why each generation ended (fleet/stops.py)

    def as_dict(self) -> dict:
        return asdict(self)

    def add_request(self, prompt_tokens: int, reused_tokens: int, generated_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused_tokens
        self.prefilled_tokens += prompt_tokens - reused_tokens
        self.generated_tokens += generated_tokens


class FirstTokenClock:
    """A logits processor that only notes when the first token's logits exist: (perf_counter, process_time) then.
    From the generate() call to then is the request's prefill (its time to first token). On a GPU it waits for
    them first: kernels run asynchronously, so without the wait it would time the host's launches."""

    def __init__(self) -> None:
        self.at: tuple[float, float] | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            if scores.is_cuda:
                import torch

                torch.cuda.synchronize(scores.device)
            self.at = (time.perf_counter(), time.process_time())
        return scores


def decode_kv_bytes(model, prompt_tokens: int, generated_tokens: int) -> int:
    """Attention KV read by one sequence's decode steps (step t reads prompt + t tokens)."""
    from prefixlab.fleet.siblings import kv_bytes_per_token

    steps = range(1, generated_tokens)
    return sum(prompt_tokens + t for t in steps) * kv_bytes_per_token(model)


def _generate(model, tokens, max_new_tokens: int, cache=None, sampling: tuple = (),
              stops: dict | None = None) -> tuple[list[int], float]:
    """One prompt's generate() (through `cache` if given), greedy or (`sampling`: Prompt.sampling) sampled from a
    generator seeded for it alone, with the stop options `stops` (fleet/stops.generate_options): (new token ids,
    prefill wall seconds)."""
    import contextlib

    import torch
    from transformers import LogitsProcessorList

    from prefixlab.cache.hooks import cache_keyword
    from prefixlab.fleet.generation_options import GREEDY

    input_ids = prompt_ids(model, tokens)
    options = dict(sampling)
    seed = options.pop("seed", None)
    decoding = GREEDY | ({"do_sample": True} | options if options else {})
    # (the process's own random state is left as it was, other GPUs' too: the prompt's draws depend on its seed alone)
    rng = (torch.random.fork_rng(devices=[input_ids.device] if input_ids.is_cuda else [])
           if seed is not None else contextlib.nullcontext())
    clock, started = FirstTokenClock(), time.perf_counter()
    with rng:
        if seed is not None:  # the generators the draws use, not torch.manual_seed's every device (forked: this one)
            torch.random.default_generator.manual_seed(seed)
            if input_ids.is_cuda:
                with torch.cuda.device(input_ids.device):
                    torch.cuda.manual_seed(seed)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             **decoding, pad_token_id=_pad_id(model), logits_processor=LogitsProcessorList([clock]),
                             **({cache_keyword(model): cache} if cache is not None else {}), **(stops or {}))
    return out[0, input_ids.shape[1]:].tolist(), clock.at[0] - started


def generate(model, store, tokens, max_new_tokens: int, sampling: tuple = (),
             stops: dict | None = None) -> tuple[list[int], int, str, float]:
    """Generation of one prompt through the store: (new token ids, prompt tokens reused, the reason code of
    cache.report() for that reuse, prefill wall seconds)."""
    from prefixlab.cache.hf import HybridPrefixCache

    cache = HybridPrefixCache(store)
    output_ids, prefill_seconds = _generate(model, tokens, max_new_tokens, cache, sampling, stops)
    reason = cache.report().rows[0].reason  # report() admits now, so the next step can reuse this one
    return output_ids, cache.reused_tokens, reason, prefill_seconds


def generate_uncached(model, tokens, max_new_tokens: int, sampling: tuple = (), stops: dict | None = None) -> list[int]:
    """The same generation without prefixlab (the exactness reference)."""
    return _generate(model, tokens, max_new_tokens, sampling=sampling, stops=stops)[0]


def serve_plain(model, prompts: Sequence[Prompt], stats: ProcessStats | None = None,
                stop_tokenizer=None) -> dict[str | int, list[int]]:
    """The baseline: `prompts` one by one through a plain generate() loop, without prefixlab (the model must not be
    patched); returns id -> new token ids and counts into `stats` like serve(). `stop_tokenizer`: what stop strings
    are matched with (PromptTokenizer.stopping_tokenizer)."""
    import torch

    from prefixlab.fleet.stops import generate_options

    stats = stats if stats is not None else ProcessStats()
    outputs, started = {}, time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            stops = generate_options(model, prompt.stop_token_ids, prompt.stop_strings, stop_tokenizer)
            outputs[prompt.id], prefill_seconds = _generate(model, prompt.tokens, prompt.max_new_tokens,
                                                            sampling=prompt.sampling, stops=stops)
            stats.add_request(len(prompt.tokens), 0, len(outputs[prompt.id]))
            stats.prefill_seconds += prefill_seconds
    stats.seconds += time.perf_counter() - started
    return outputs


def served_alone(model, prompt: Prompt) -> bool:
    """Whether `prompt` leaves its sibling batch to be served alone: a sampled prompt's draws are its own seed's, not
    a batch's; stop strings are matched over the whole sequence, which a padded row's is not; stop token ids that
    options of the generation config read as EOS ids (generation_options.eos_reading_options)."""
    from prefixlab.fleet.generation_options import eos_reading_options

    return bool(prompt.sampling or prompt.stop_strings or eos_reading_options(model, prompt.stop_token_ids))


def prime(model, store, tokens) -> int:
    """Prefill `tokens` alone through the store (so it keeps a checkpoint at their end); returns tokens computed."""
    from prefixlab.cache.hf import HybridPrefixCache
    from prefixlab.cache.hooks import cache_keyword, forward_parameters

    cache = HybridPrefixCache(store)
    input_ids = prompt_ids(model, tokens)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}  # skip the LM head
    model(input_ids=input_ids, use_cache=True, **{cache_keyword(model): cache}, **keep)
    store.flush()
    return len(tokens) - cache.reused_tokens


def prompt_ids(model, tokens):
    """One prompt's token ids as generate's [1, T] input on the model's device; InvalidInputError (before any lookup)
    for what is not a flat sequence of int ids (floats and bools were truncated to ids, served and admitted)."""
    import torch

    from prefixlab.cache.tokens import as_tokens

    return torch.as_tensor(as_tokens(tokens, "the prompt's tokens"), device=model.device)[None]


def _resumable(store, tokens) -> int:
    """How much of `tokens` the store can resume now (its pending admissions made first)."""
    store.flush()
    with store.lock:
        return store.core.peek(tokens)[0]


def _pad_id(model) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def serve(model, store, prompts: Sequence[Prompt], steps: Sequence[tuple[int | tuple[int, ...], int]],
          write: Callable[[dict], None],
          *, process: int = 0, decode: Callable[[list[int]], str] | None = None,
          progress: Callable[[int], object] | None = None, stats: ProcessStats | None = None,
          model_digest: str | None = None, stop_tokenizer=None) -> ProcessStats:
    """Run `steps` ((prompt index, prime length) from prefixlab.fleet.schedule, or ((indices...), prime length):
    siblings batched by prefixlab.fleet.siblings) over `prompts`, writing one record per finished prompt with
    `write` (with the prompt's fingerprint and `model_digest`, which a resumed run checks, and its finish_reason).
    `stop_tokenizer` matches the prompts' stop strings (PromptTokenizer.stopping_tokenizer). Counts go into `stats`
    as they happen (what a stopped run did is kept)."""
    import torch

    from prefixlab.fleet.siblings import generate_group, kv_bytes_per_token
    from prefixlab.fleet.stops import ends_on_stop_string, eos_ids, finish_reason, generate_options

    stats = stats if stats is not None else ProcessStats(process=process)
    started = time.perf_counter()

    def finish(prompt: Prompt, output_ids: list[int], reused: int, why: str) -> None:
        record = {"id": prompt.id, "output_ids": output_ids, "prompt_tokens": len(prompt.tokens),
                  "reused_tokens": reused, "process": process, "request": prompt.fingerprint, "finish_reason": why}
        if model_digest is not None:
            record["model"] = model_digest
        if decode is not None:
            record["text"] = decode(output_ids)
        write(record)
        stats.finish_reasons[why] = stats.finish_reasons.get(why, 0) + 1
        stats.add_request(len(prompt.tokens), reused, len(output_ids))
        stats.seconds = time.perf_counter() - started
        if progress is not None:
            progress(1)

    def serve_one(prompt: Prompt) -> None:
        output_ids, reused, reason, prefill_seconds = generate(
            model, store, prompt.tokens, prompt.max_new_tokens, prompt.sampling,
            generate_options(model, prompt.stop_token_ids, prompt.stop_strings, stop_tokenizer))
        stats.prefill_seconds += prefill_seconds
        stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
        stats.kv_bytes_read += decode_kv_bytes(model, len(prompt.tokens), len(output_ids))
        held = (len(prompt.tokens) + max(len(output_ids) - 1, 0)) * kv_bytes_per_token(model)
        stats.kv_bytes_held_peak = max(stats.kv_bytes_held_peak, held)
        matched = (lambda: ends_on_stop_string([*prompt.tokens.tolist(), *output_ids], prompt.stop_strings,
                                               stop_tokenizer)) if prompt.stop_strings else None
        finish(prompt, output_ids, reused, finish_reason(output_ids, prompt.max_new_tokens, eos_ids(model),
                                                         prompt.stop_token_ids, matched))

    batching = True
    with torch.inference_mode():
        for index, length in steps:
            if isinstance(index, tuple):  # siblings under a prime of `length` tokens: one Hydragen batch
                group, result = [prompts[i] for i in index], None
                alone = [p for p in group if served_alone(model, p)]
                for prompt in alone:
                    serve_one(prompt)
                group = [p for p in group if p not in alone]
                try:
                    if batching and len(group) > 1:
                        result = generate_group(model, store, [p.tokens for p in group], length,
                                                [p.max_new_tokens for p in group], _pad_id(model),
                                                [p.stop_token_ids for p in group])
                except PrefixlabError as err:  # raised before any output, the store left as it was
                    batching = False
                    print(f"prefixlab: note: --hydragen: cannot batch this model's siblings ({err}); serving "
                          "prompts one by one", file=sys.stderr)
                if result is None:  # no batching, or the prime's prefix left the store: serve them one by one
                    for prompt in group:
                        serve_one(prompt)
                    continue
                stats.batches += 1
                stats.batched_requests += len(group)
                stats.padding_tokens += result.padding_tokens
                stats.prefill_seconds += result.prefill_seconds
                stats.prefilled_tokens += result.padding_tokens
                stats.kv_bytes_read += result.kv_bytes_read
                stats.kv_bytes_held_peak = max(stats.kv_bytes_held_peak, result.kv_bytes_held)
                # not a store report (the batch reads the prime's entry, nothing is admitted): its own reason
                stats.reasons["hydragen_batch"] = stats.reasons.get("hydragen_batch", 0) + len(group)
                for prompt, output_ids, why in zip(group, result.outputs, result.finish_reasons, strict=True):
                    finish(prompt, output_ids, result.reused_tokens, why)
                continue
            prompt = prompts[index]
            if length and _resumable(store, prompt.tokens[:length]) >= length:
                continue  # (an earlier prompt left it: a prime would recompute its last token for nothing)
            if length:
                prime_started = time.perf_counter()
                computed = prime(model, store, prompt.tokens[:length])
                stats.prefill_seconds += time.perf_counter() - prime_started
                stats.prime_tokens += computed
                stats.prefilled_tokens += computed
                continue
            serve_one(prompt)
    return stats
