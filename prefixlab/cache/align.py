"""Rows of a batch resume at one column (hf.py), so a row reuses only where it holds a checkpoint at that column
minus its left pads: rows of different lengths under one cached prompt hold its checkpoint at different columns,
and such a batch would reuse nothing. `prime_rows` (called by the hooks before a batch's first forward) prefills
each such row alone from its own deepest checkpoint up to the batch's deepest column, as `prefixlab run` primes a
shared prefix; the store keeps the state there and the batch then resumes every row at that column. It primes only
where that reuses more of the store than the batch would without it. The tokens a prime computes are not counted as
reused: each row reports what its prime found (`HybridPrefixCache.primed`), what the store held before."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixlab.cache.rows import left_pads, one_column, real_positions


def aligned_reuse(peek, rows: Sequence[torch.Tensor], pads: Sequence[int], column: int) -> list[int]:
    """Each row's reuse when the batch resumes at one column at or before `column` (HybridPrefixCache._resume's
    search, on `peek(tokens) -> the deepest checkpoint in tokens`)."""
    found = [peek(row[: column - pad]) if column > pad else 0 for row, pad in zip(rows, pads, strict=True)]
    return one_column(found, list(pads), lambda row, limit: peek(rows[row][:limit]))


def prime_rows(model: torch.nn.Module, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None, logits_tokens: int, cache_keyword: str,
               takes_logits_to_keep: bool) -> None:
    """Before `cache`'s first forward over `input_ids` [batch, length]: prime the rows (see the module docstring)
    when that reuses more; sets `cache.primed` (per row, its prime's report; None: not primed)."""
    from prefixlab.cache.hf import HybridPrefixCache

    store, (batch, length) = cache.store, input_ids.shape
    if batch < 2 or store.closed:
        return
    pads = left_pads(attention_mask, batch, length)
    if pads is None or not real_positions(position_ids, pads, length, bool(store.layout.kv_layers)):
        return  # (the batch runs uncached: begin)
    column = length - max(store.min_prefill_tokens, min(logits_tokens, length))
    rows = [input_ids[b, pad:].detach().cpu() for b, pad in enumerate(pads)]

    def peek(tokens: torch.Tensor) -> int:
        return store.core.peek(tokens.numpy(), cache.namespace)[0] if len(tokens) else 0

    store.flush()  # the caches of earlier requests are admitted on the store's next use: now
    with store.lock:  # (no forward runs under it)
        own = [peek(row[: column - pad]) if column > pad else 0 for row, pad in zip(rows, pads, strict=True)]
        if sum(own) <= sum(aligned_reuse(peek, rows, pads, column)):
            return
    primed: list = [None] * batch
    done: dict[tuple, object] = {}  # rows primed already, by their tokens (beams, num_return_sequences: repeats)
    extra = {"logits_to_keep": 1} if takes_logits_to_keep else {}  # only the state at the end matters
    cache.prime_locks = []  # a later prime must not evict an earlier one's state: held until begin (release_primes)
    try:
        with torch.no_grad():
            for b, (row, pad, depth) in enumerate(zip(rows, pads, own, strict=True)):
                if column - pad <= depth:  # a checkpoint at the column already (or only pads before it)
                    continue
                key = tuple(row[: column - pad].tolist())
                if key in done:
                    primed[b] = done[key]
                    continue
                prime = HybridPrefixCache(store, cache.namespace)
                model(input_ids=row[None, : column - pad].to(input_ids.device), use_cache=True,
                      **{cache_keyword: prime}, **extra)
                primed[b] = done[key] = prime.report().rows[0]  # (report commits: the store keeps the state)
                store.record_request([], replacing=[primed[b]])  # the batch counts the row
                cache.prime_locks.append(store.lookup(row[: column - pad].numpy(), cache.namespace, count=False))
    except BaseException:
        release_primes(cache)
        raise
    cache.primed = primed


def release_primes(cache) -> None:
    """Unlock the primed states `prime_rows` held for `cache`'s first forward (after it looked them up)."""
    locks, cache.prime_locks = getattr(cache, "prime_locks", []), []
    for pair in locks:
        cache.store.release_lookup(*pair)
