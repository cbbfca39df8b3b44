"""Sibling batching: prompts under the same primed prefix generate as the rows of ONE batch through Hydragen.

`group_siblings` rewrites a radix schedule (prefixlab.fleet.schedule.radix_schedule): the consecutive prompts
served under the same deepest prime become one group step `((index, ...), prime length)`. `generate_group` serves a
group: the store's cached prefix (the prime's checkpoint) is loaded ONCE as Hydragen's shared level
(prefixlab.attention.compose.hydragen_cache_from_store), each row's own tokens after it are prefilled and every row
decodes in one `generate` call.

Exactness (greedy tokens of each row = the uncached model's, tested per family in tests/test_fleet_siblings.py):
- attention-only models ("ragged"): rows of different lengths are left-padded BETWEEN the shared prefix and their
  own tokens and prefilled in one batch; the attention mask hides the padding and generate's position ids (the
  mask's cumsum) keep every real token at its own position.
- hybrids of attention + linear-attention layers ("rows"): a recurrent or conv layer would run over padding and
  carry it in its state, so rows of different lengths are prefilled apart from each other's padding (all but their
  last token) over the shared level, then joined (`HydragenCache.join_rows`: the level once, suffix KV left-padded
  with zeros and masked, each row's own states) and decoded as one batch. With patched layers the rows' prefills
  run together, right-padded: each row's states are captured at its own end and its KV cut there (in buckets
  whose pads add at most 25 % on a CPU, 100 % on a GPU); otherwise one by one. Equal-length rows need no padding:
  one batched prefill.
- other layer kinds ("equal"): only rows of equal length are batched; the rest are served one by one.
Per-row `max_new_tokens` and stop token ids are exact: greedy decoding is prefix-consistent, so each row keeps its
first `max_new_tokens` tokens, cut after its first EOS or stop token as `generate` of that row alone would stop (a
row done early is padded by generate while the others decode; fleet/stops.row_stops).

Admission: a Hydragen batch is not admitted into the store (its KV sits in Hydragen's shared + suffix layout). The
prime step before the group already left the store its checkpoint; the siblings' own tokens are not cached, so a
later prompt that the plain path would resume from a sibling's end (it shares a node the radix schedule does not
prime, e.g. shallower than its min_prefix_tokens) prefills more. The summary counts what really ran.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixlab.fleet.generation_options import GREEDY, eos_reading_options, prompt_reading_options
from prefixlab.fleet.schedule import common_prefix

Step = tuple[int | tuple[int, ...], int]


@dataclass(frozen=True)
class GroupResult:
    """What one batched group did: per-row outputs, prefix tokens served from the store (every row), padding."""

    outputs: list[list[int]]
    reused_tokens: int
    padding_tokens: int
    kv_bytes_read: int  # attention KV read by the decode steps (the shared level once per step)
    kv_bytes_held: int  # attention KV the batch held at its end (the shared level once, padding slots included)
    prefill_seconds: float = 0.0  # wall time to the first token's logits (the rows' prefills included)
    finish_reasons: tuple[str, ...] = ()  # per row: "stop", "eos" or "length" (fleet/stops.finish_reason)


def batching_mode(model) -> str | None:
    """How siblings of `model` batch: "ragged" (every layer full attention: one padded prefill is exact), "rows"
    (attention + linear-attention layers: each row prefilled alone, then joined for one batched decode), "equal"
    (other layer kinds, or decode steps that differ from prefills: equal lengths only), or None (no attention layer
    HydragenCache can share)."""
    from transformers.cache_utils import LinearAttentionLayer

    from prefixlab.attention.hf_cache import HydragenCache, SharedPrefixLayer
    from prefixlab.cache.model_info import decode_differs_from_prefill
    from prefixlab.errors import PrefixlabError

    try:
        layers = HydragenCache(model.config).layers
    except (PrefixlabError, KeyError, ValueError):
        return None
    shared = [isinstance(layer, SharedPrefixLayer) for layer in layers]
    if not any(shared):
        return None
    if all(shared):
        return "ragged"
    joinable = all(isinstance(layer, SharedPrefixLayer) or type(layer) is LinearAttentionLayer for layer in layers)
    # "rows" decodes each row's last prompt token as a one-token step, not exact where those differ from prefills
    return "rows" if joinable and not decode_differs_from_prefill(model) else "equal"


def _moves_rope_frequencies(model, positions: int) -> bool:
    """Whether a batch reaching `positions` positions changes a position-dependent RoPE's frequencies ("dynamic",
    "longrope": transformers rescales them for the whole batch once its longest row passes the original context)."""
    text = model.config.get_text_config()
    params = getattr(text, "rope_parameters", None) or {}
    kinds = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    if not any("dynamic" in str(p.get("rope_type")) or p.get("rope_type") == "longrope" for p in kinds):
        return False
    limit = min(p.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
                or text.max_position_embeddings for p in kinds)
    return positions > limit


def group_siblings(prompts: Sequence[np.ndarray], steps: Sequence[tuple[int, int]], mode: str,
                   max_batch: int = 16) -> list[Step]:
    """`steps` with the serve steps under one prime merged into group steps ((indices...), prime length).

    A prompt belongs to the deepest prime whose tokens it starts with and must have a token of its own after it.
    mode "equal" groups only equal-length prompts (one group per length); "ragged" and "rows" group any (see
    batching_mode). Groups of one stay plain serve steps (index, 0); prime steps stay as they are.
    """
    out: list[Step] = []
    primes: list[tuple[int, int]] = []  # (prompt index, depth): the primes whose subtree we are in, shallow first
    run: list[int] = []
    run_key: tuple[int, int] | None = None  # the prime the run is under

    def flush() -> None:
        buckets: dict[int, list[int]] = {}
        for i in run:
            buckets.setdefault(len(prompts[i]) if mode == "equal" else 0, []).append(i)
        for members in buckets.values():
            for start in range(0, len(members), max_batch):
                chunk = members[start:start + max_batch]
                out.extend([(chunk[0], 0)] if len(chunk) == 1 else [(tuple(chunk), run_key[1])])
        run.clear()

    for index, length in steps:
        if length:
            flush()
            out.append((index, length))
            primes.append((index, length))
            continue
        tokens = prompts[index]
        while primes and common_prefix(tokens, prompts[primes[-1][0]][:primes[-1][1]]) < primes[-1][1]:
            primes.pop()
        key = primes[-1] if primes and len(tokens) > primes[-1][1] else None
        if key != run_key or key is None:
            flush()
            run_key = key
        if key is not None:
            run.append(index)
        else:
            out.append((index, 0))
    flush()
    return out


def kv_bytes_per_token(model) -> int:
    """Attention KV bytes one token holds over every attention layer, as the store counts them (the cost model's
    per-family layout: 0 for a model without attention, MLA's latent, Zamba2's shared blocks)."""
    from prefixlab.cache.costmodel import ModelSpec

    return ModelSpec.from_config(model.config, dtype=model.dtype).kv_bytes_per_token


def keep_row(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """A row of a longer greedy batch as `generate` of that row alone returns it: `max_new_tokens`, cut after EOS."""
    tokens = tokens[:max_new_tokens]
    for k, token in enumerate(tokens):
        if token in eos:
            return tokens[:k + 1]
    return tokens


def generate_group(model, store, rows: Sequence[np.ndarray], shared_length: int,
                   max_new_tokens: Sequence[int], pad_id: int = 0,
                   stop_token_ids: Sequence[Sequence[int]] | None = None) -> GroupResult | None:
    """Greedy generation of `rows` (prompts that share their first `shared_length` tokens) as one Hydragen batch
    over the store's cached prefix, each row stopping at its own `stop_token_ids` too; None where a hybrid's ragged
    rows find no prefix in the store (serve them one by one). The model must use attn_implementation="hydragen"."""
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList

    from prefixlab.attention.compose import hydragen_cache_from_store
    from prefixlab.errors import InvalidInputError
    from prefixlab.fleet.serve import FirstTokenClock
    from prefixlab.fleet.stops import eos_ids, finish_reason, row_stops

    rows = _checked_group(model, rows, shared_length, max_new_tokens, stop_token_ids)
    mode = batching_mode(model)
    if mode is None:
        raise InvalidInputError(f"{type(model).__name__} has no attention layer HydragenCache can share: serve its "
                                "prompts one by one")
    if options := prompt_reading_options(model):
        raise InvalidInputError(f"the model's generation config sets {', '.join(options)}, which read each prompt's "
                                "tokens or length, and a padded batch would change them: serve prompts one by one")
    if options := eos_reading_options(model, {t for ids in stop_token_ids or () for t in ids}):
        raise InvalidInputError(f"the model's generation config sets {', '.join(options)}, which read the stop token "
                                "ids a prompt served alone adds to its EOS ids, and a batch cannot: serve the rows "
                                "with stop_token_ids one by one")
    if _moves_rope_frequencies(model, max(len(r) for r in rows) + max(max_new_tokens)):
        return None  # (each row alone may stay under the length where the frequencies change: one by one)
    ragged = len({len(r) for r in rows}) > 1
    if mode == "equal" and ragged:
        raise InvalidInputError(f"{type(model).__name__} has layers that would run over the padding of rows of "
                                "different lengths: batch equal lengths only (group_siblings mode 'equal')")
    if any(len(r) <= shared_length or common_prefix(r, rows[0]) < shared_length for r in rows):
        raise InvalidInputError(f"every row must start with the same {shared_length} tokens and have more")
    # the store serves the head but its last store.min_prefill_tokens: the prime's checkpoint at shared_length
    head = torch.as_tensor(rows[0][:shared_length + store.min_prefill_tokens], dtype=torch.long)[None]
    started = time.perf_counter()
    computed_pads = 0  # right pads the rows' prefills computed (joined rows: left pads are zeros, not computed)
    if mode == "rows" and ragged:  # recurrent layers must not see padding: rows prefilled apart, decoded together
        prefilled = _prefill_rows(model, store, head, rows)
        if prefilled is None:
            return None
        cache, computed_pads = prefilled
    else:  # one prefill of [served prefix | padding | each row's own tokens]
        cache = hydragen_cache_from_store(store, head, batch_size=len(rows))
    from prefixlab.attention.hf_cache import SharedPrefixLayer

    # tokens served from the store: <= shared_length, 0 on a miss
    reused = next(layer.prefix_length for layer in cache.layers if isinstance(layer, SharedPrefixLayer))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, tokens in enumerate(rows):  # [served prefix | padding | the row's own tokens]
        gap = width - len(tokens)
        ids[b, :reused], ids[b, reused + gap:] = torch.as_tensor(tokens[:reused]), torch.as_tensor(tokens[reused:])
        mask[b, :reused], mask[b, reused + gap:] = 1, 1
    padding = computed_pads if mode == "rows" and ragged else int((width - mask.sum(1)).sum())
    clock = FirstTokenClock()
    stops = [set(ids) for ids in stop_token_ids] if stop_token_ids is not None else [set()] * len(rows)
    # (rows that stop on their own ids are done early: the batch ends once every row is)
    criteria = StoppingCriteriaList([row_stops(max_new_tokens, stops, width)] if any(stops) else [])
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), past_key_values=cache,
                         max_new_tokens=max(max_new_tokens), **GREEDY, pad_token_id=pad_id,
                         logits_processor=LogitsProcessorList([clock]), stopping_criteria=criteria)
    eos = eos_ids(model)
    outputs = [keep_row(out[b, width:].tolist(), n, set(eos) | stops[b]) for b, n in enumerate(max_new_tokens)]
    reasons = tuple(finish_reason(row, n, eos, stops[b]) for b, (row, n) in enumerate(zip(outputs, max_new_tokens,
                                                                                           strict=True)))
    generated = out.shape[1] - width  # decode steps actually run (all rows stopped at EOS: fewer)
    # decode step t (t = 1 .. generated - 1) reads the shared level once and each row's suffix of width - reused + t
    per_token = kv_bytes_per_token(model)
    read = sum(reused + len(rows) * (width - reused + t) for t in range(1, generated)) * per_token
    held = (reused + len(rows) * (width - reused + max(generated - 1, 0))) * per_token
    return GroupResult(outputs, reused, padding, read, held, clock.at[0] - started, reasons)


def _checked_group(model, rows: Sequence[np.ndarray], shared_length: int, max_new_tokens, stop_token_ids) -> list:
    """`rows` as int64 arrays, or InvalidInputError before any lookup (float ids were truncated; a max_new_tokens or
    stop_token_ids of another length dropped or cut rows, or failed after the lookup)."""
    import torch

    from prefixlab.cache.model_info import check_token_ids
    from prefixlab.cache.tokens import as_tokens
    from prefixlab.errors import InvalidInputError, is_int

    if not is_int(shared_length) or shared_length < 0:
        raise InvalidInputError(f"shared_length={shared_length!r} must be an int >= 0 (the tokens every row shares)")
    if not len(rows):
        raise InvalidInputError("rows must hold at least one prompt's token ids")
    if len(max_new_tokens) != len(rows) or not all(is_int(n) and n >= 1 for n in max_new_tokens):
        raise InvalidInputError(f"max_new_tokens={list(max_new_tokens)!r} must hold one positive int per row "
                                f"({len(rows)} rows)")
    if stop_token_ids is not None and len(stop_token_ids) != len(rows):
        raise InvalidInputError(f"stop_token_ids must hold one list of ids per row ({len(rows)} rows) or be None")
    checked = [as_tokens(row, "the prompt's tokens") for row in rows]  # (on the host: no trip to the device and back)
    for ids in checked:
        check_token_ids(torch.from_numpy(ids)[None], model)
    return checked


def _prefill_rows(model, store, head, rows: Sequence[np.ndarray]):
    """(A joined HydragenCache of `rows`, the right pads computed): each row prefilled (all but its last token) over
    the store's prefix of `head[:-1]` without padding reaching its states; None on a store miss (a row without own
    tokens would then have no recurrent state to join). With patched layers rows are prefilled together,
    right-padded, each row's states captured at its own end (as align.py primes a padded batch; on a CPU in buckets
    of few pads); else one by one."""
    import torch
    from transformers.cache_utils import LinearAttentionLayer

    from prefixlab.attention.compose import hydragen_cache_from_store
    from prefixlab.attention.hf_cache import HydragenCache, SharedPrefixLayer
    from prefixlab.cache.align import padded_buckets, prime_padding

    first = hydragen_cache_from_store(store, head, batch_size=1)
    reused = first.get_seq_length()
    if not reused:
        return None
    levels = {i: layer.levels[0] for i, layer in enumerate(first.layers) if isinstance(layer, SharedPrefixLayer)}
    recurrent = [i for i, layer in enumerate(first.layers) if isinstance(layer, LinearAttentionLayer)]
    stateful = recurrent if first.keeps_recurrent_state else []  # (LFM2's conv layers keep no recurrent state)
    start = ({i: first.layers[i].conv_states[0].clone() for i in recurrent},  # (a forward over `first` would
             {i: first.layers[i].recurrent_states[0].clone() for i in stateful})  # change them in place)

    def loaded(batch: int, states: tuple[dict, dict] = start) -> HydragenCache:  # the same level tensors: joinable
        cache = HydragenCache(model.config, share_new_tokens=False)
        cache.load_shared_prefix({i: lv.keys for i, lv in levels.items()}, {i: lv.values for i, lv in levels.items()},
                                 batch_size=batch, conv_states=states[0], recurrent_states=states[1])
        return cache

    own = [len(tokens) - 1 - reused for tokens in rows]
    todo = [b for b, n in enumerate(own) if n > 0]
    padding = prime_padding(model.device)
    groups = padded_buckets(todo, [own[b] for b in todo], padding) if store.records_in_kernel else [[b] for b in todo]
    caches: list = [None] * len(rows)
    pads = 0
    for group in groups:
        together = len(group) > 1 and _prefill_together(model, [rows[b][reused:-1] for b in group], reused, loaded,
                                                        recurrent, levels)
        for b, cache in zip(group, together or [None] * len(group), strict=True):
            if cache is None:
                cache = loaded(1)
                _forward(model, cache, torch.as_tensor(rows[b][reused:-1])[None], reused)
            caches[b] = cache
        if together:
            pads += len(group) * max(own[b] for b in group) - sum(own[b] for b in group)
    # a row without tokens of its own holds the prefix's state
    return HydragenCache.join_rows(model.config, [cache or loaded(1) for cache in caches]), pads


def _forward(model, cache, ids, start: int, lengths: list[int] | None = None) -> None:
    """One prefill of `ids` [batch, n] over `cache` at positions start.. (given: some models (Bamba) number a
    forward's tokens from 0 without them, even over a cache); `lengths`: each row's tokens, right pads after them
    (masked, and at the row's last position, as Hydragen's position check asks of a row's last query)."""
    import torch

    from prefixlab.cache.hooks import forward_parameters
    from prefixlab.cache.rows import right_pad_mask

    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}
    lengths = lengths or [ids.shape[1]] * ids.shape[0]
    positions = start + torch.minimum(torch.arange(ids.shape[1])[None], torch.tensor(lengths)[:, None] - 1)
    mask = torch.cat([torch.ones(len(lengths), start, dtype=torch.long), right_pad_mask(lengths, ids.shape[1])], dim=1)
    model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
          position_ids=positions.to(model.device), past_key_values=cache, use_cache=True, **keep)


def _prefill_together(model, tokens: list[np.ndarray], start: int, loaded, recurrent: list[int],
                      levels: dict) -> list | None:
    """Batch-1 caches of rows `tokens` prefilled in one right-padded forward over a batch cache of the shared
    level (`loaded(batch)`): each row's suffix KV cut at its end, its states those the patched layers captured
    there by row; None where a recurrent layer reported none (not patched)."""
    import torch

    from prefixlab.cache.rows import right_pad

    lengths = [len(t) for t in tokens]
    ids, _ = right_pad([torch.as_tensor(t, dtype=torch.long) for t in tokens])
    captured: dict[tuple[int, int], tuple] = {}
    cache = loaded(len(tokens))
    cache.prefixlab_capture_positions = [[n] for n in lengths]
    cache.prefixlab_record = lambda layer, offset, conv, state, row=None: captured.__setitem__((row, layer),
                                                                                           (conv, state))
    _forward(model, cache, ids, start, lengths)
    if any((row, i) not in captured for row in range(len(tokens)) for i in recurrent):
        return None
    rows = []
    for row, n in enumerate(lengths):
        one = loaded(1, ({i: captured[row, i][0] for i in recurrent},
                         {i: captured[row, i][1] for i in recurrent if captured[row, i][1] is not None}))
        for i in levels:
            keys, values = cache.layers[i].keys[row : row + 1, :, :n], cache.layers[i].values[row : row + 1, :, :n]
            one.layers[i].lazy_initialization(keys, values)
            one.layers[i].keys, one.layers[i].values = keys, values
        rows.append(one)
    return rows
