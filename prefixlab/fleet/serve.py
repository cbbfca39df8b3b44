"""One process's share of a batch: the model, its PrefixStore, and the loop over scheduled steps."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefixlab.errors import InvalidInputError, PrefixlabError
from prefixlab.fleet import model_config
from prefixlab.fleet.model_config import causal_lm_class, check_builds, config_value_errors, load_config, reason
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


def load_model(model: str, seed: int = 0, device: str = "cpu", meta: bool = False):
    """A transformers causal LM from a config.json (random init after torch.manual_seed(seed), so every process
    builds the same weights) or a local model folder with weights (from_pretrained, local files only), in eval
    mode on `device`. `meta`: the same model on the meta device, no weights read or made (`run --plan`): its
    config, generation config, dtype (as from_pretrained picks it: the config's, else the first checkpoint file's)
    and module structure only."""
    import torch

    path = Path(model)
    if not path.exists():
        raise InvalidInputError(f"--model {model!r}: no such file or folder; pass a config.json or a local model "
                                "folder (nothing is downloaded)")
    has_weights = path.is_dir() and bool(_weights_files(path))
    if path.is_dir() and not has_weights:  # a folder whose weights never arrived must not serve random ones
        raise InvalidInputError(f"--model {model!r} is a folder without weights (*.safetensors or *.bin); pass a "
                                "folder with them, or its config.json to run random-init weights on purpose")
    config = load_config(model, path, generation=True)
    auto = causal_lm_class(config)
    try:
        if meta:
            return _meta_model(auto, config, path if has_weights else None)
        if has_weights:
            loaded, info = auto.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
        else:
            torch.manual_seed(seed)
            loaded, info = auto.from_config(config), {}
    except (*config_value_errors(), AssertionError, OSError) as err:
        check_builds(model, path, auto, config)  # else not a value of config.json: an error of its own
        if isinstance(err, (AttributeError, IndexError, ZeroDivisionError, AssertionError)):  # not the input's
            raise
        raise InvalidInputError(f"--model {model!r}: cannot build a causal LM ({reason(err)})") from None
    except _weights_read_errors() as err:
        damaged = _unreadable_weights(path) if has_weights else None
        if damaged is None and has_weights and "ignore_mismatched_sizes" in str(err):  # (transformers' wording)
            raise InvalidInputError(f"--model {model!r}: its weights do not fit its config.json (tensor shapes differ; "
                                    "transformers printed which above): pass the folder's own config, the one the "
                                    "weights were saved with") from None
        if damaged is None:  # every file reads: a value of config.json (a negative size), else not the input's error
            check_builds(model, path, auto, config)
            raise
        raise InvalidInputError(f"--model {model!r}: the weights file {damaged}; it is damaged or incomplete, or not "
                                "a checkpoint: copy or save it again") from None
    return model_config.check_runs(model, path, loaded.to(device).eval(), info)


def _weights_files(folder: Path) -> list[Path]:
    """`folder`'s weights files, safetensors first (from_pretrained's preference)."""
    return [*sorted(folder.glob("*.safetensors")), *sorted(folder.glob("*.bin"))]


def _weights_read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged weights file raises: safetensors' header error; torch's zip reader (RuntimeError),
    weights-only unpickler, or a file cut short (EOFError)."""
    import pickle

    from safetensors import SafetensorError

    return SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError


def _checkpoint_files(folder: Path) -> list[Path]:
    """The weights files from_pretrained reads from `folder`, in its order: model.safetensors, else the shards its
    index names, else pytorch_model.bin, else its index's shards (other files, such as a Trainer's
    training_args.bin or an adapter's safetensors, are never read); `_weights_files` where none of these is there."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError, OSError):
                break  # (from_pretrained refuses the index itself)
            return [folder / name for name in shards if (folder / name).is_file()] or _weights_files(folder)
    return _weights_files(folder)


def _unreadable_weights(folder: Path) -> str | None:
    """The first weights file of `folder` that from_pretrained reads and that does not read as a checkpoint (its
    header and tensor list only, on the meta device), and why; None if every one reads (what failed was not a
    file)."""
    from transformers.modeling_utils import load_state_dict

    for file in _checkpoint_files(folder):
        try:
            load_state_dict(str(file), map_location="meta")
        except _weights_read_errors() as err:
            why = " ".join(str(err).split(". ")[0].split()) or type(err).__name__  # (torch's advice left out)
            return f"{file.name} cannot be read ({why})"
    return None


def _meta_model(auto, config, folder: Path | None):
    """`auto`'s model of `config` on the meta device, with the dtype and generation config from_pretrained would
    give it from `folder` (None: from_config's)."""
    import torch
    from transformers import GenerationConfig

    options = {}
    if folder is not None:
        dtype = getattr(config, "dtype", None)
        if dtype is None:  # from_pretrained's "auto": the first floating tensor of the first checkpoint file
            from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

            first = _checkpoint_files(folder)[0]
            dtype = get_state_dict_dtype(load_state_dict(str(first), map_location="meta"))
        options["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        loaded = auto.from_config(config, **options)
    if folder is not None and (folder / "generation_config.json").is_file():
        loaded.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return loaded.eval()


def model_digest(model) -> str:
    """A short hash of what outputs depend on besides the prompt: (a sample of) the weights' bits, the config and
    the generation config (a rope_theta or eos_token_id of their own changes outputs, not weights). Processes
    compare it to catch differently seeded models; a resumed run, to catch another model."""
    digest = hashlib.sha256()
    for config in (model.config, model.generation_config):
        settings = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        sample = tensor.detach().reshape(-1)[:4096].cpu().contiguous()
        digest.update(name.encode())
        # float() is exact for fp16/bf16 (numpy has no bf16), so equal bits give equal bytes
        digest.update((sample.float() if sample.dtype.is_floating_point else sample).numpy().tobytes())
    return digest.hexdigest()[:16]


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
    from prefixlab.fleet.siblings import GREEDY

    input_ids = torch.as_tensor(tokens, dtype=torch.long, device=model.device)[None]
    options = dict(sampling)
    seed = options.pop("seed", None)
    decoding = GREEDY | ({"do_sample": True} | options if options else {})
    # (the process's own random state is left as it was: the prompt's draws depend on its seed alone)
    rng = (torch.random.fork_rng(devices=[input_ids.device] if input_ids.is_cuda else [])
           if seed is not None else contextlib.nullcontext())
    clock, started = FirstTokenClock(), time.perf_counter()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
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


def prime(model, store, tokens) -> int:
    """Prefill `tokens` alone through the store (so it keeps a checkpoint at their end); returns tokens computed."""
    import torch

    from prefixlab.cache.hf import HybridPrefixCache
    from prefixlab.cache.hooks import cache_keyword, forward_parameters

    cache = HybridPrefixCache(store)
    input_ids = torch.as_tensor(tokens, dtype=torch.long, device=model.device)[None]
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}  # skip the LM head
    model(input_ids=input_ids, use_cache=True, **{cache_keyword(model): cache}, **keep)
    store.flush()
    return len(tokens) - cache.reused_tokens


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
                # alone: a sampled prompt's draws are its own seed's, not a batch's; stop strings are matched over
                # the whole sequence, which a padded row's is not
                alone = [p for p in group if p.sampling or p.stop_strings]
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
