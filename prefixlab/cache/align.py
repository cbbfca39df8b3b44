"""Rows of a batch resume at one column (hf.py), so a row reuses only where it holds a checkpoint at that column
minus its left pads: rows of different lengths under one cached prompt hold its checkpoint at different columns,
and such a batch would reuse nothing. `prime_rows` (called by the hooks before a batch's first forward) prefills
each such row from its own deepest checkpoint up to the batch's deepest column, as `prefixlab run` primes a shared
prefix; the store keeps the state there and the batch then resumes every row at that column. It primes only where
that reuses more of the store than the batch would without it. Rows resuming at one depth (under one cached prompt)
are primed together: one forward over their tokens right-padded (`HybridPrefixCache.row_ends`), where patched
layers capture each row's state at its own end; a forward per row costs a GPU a launch-bound pass of every layer
per row. The tokens a prime computes are not counted as reused: each row reports what its prime found
(`HybridPrefixCache.primed`), what the store held before."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prefixlab.cache.model_info import runs_uncached
from prefixlab.cache.rows import left_pads, one_column, real_positions, right_pad


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
    store, (batch, length) = cache.store, input_ids.shape
    if batch < 2 or store.closed or getattr(cache, "row_ends", None) is not None:  # (primes are not primed)
        return
    pads = left_pads(attention_mask, batch, length)
    if pads is None or not real_positions(position_ids, pads, length, bool(store.layout.kv_layers)) or (
            runs_uncached(store, pads, length)):
        return  # (the batch runs uncached: begin)
    column = length - max(store.min_prefill_tokens, min(logits_tokens, length))
    rows = [input_ids[b, pad:].detach().cpu() for b, pad in enumerate(pads)]

    def peek(tokens: torch.Tensor) -> int:
        return store.core.peek(tokens.numpy(), cache.namespace)[0] if len(tokens) else 0

    store.flush(lookup=True)  # earlier requests' caches are admitted at the store's next use: now (not running calls')
    with store.lock:  # (no forward runs under it)
        own = [peek(row[: column - pad]) if column > pad else 0 for row, pad in zip(rows, pads, strict=True)]
        if sum(own) <= sum(aligned_reuse(peek, rows, pads, column)):
            return
        # the rows to prime, by their tokens (beams and num_return_sequences repeat rows: each is primed once)
        todo: dict[tuple, list[int]] = {}
        for b, (row, pad, depth) in enumerate(zip(rows, pads, own, strict=True)):
            if column - pad > depth:  # (else a checkpoint at the column already, or only pads before it)
                todo.setdefault(tuple(row[: column - pad].tolist()), []).append(b)
        groups = _prime_groups(store, todo, peek, prime_padding(input_ids.device))
    primed: list = [None] * batch
    cache.prime_locks = []  # a later prime must not evict an earlier one's state: held until begin (release_primes)
    try:
        with torch.no_grad():
            def run(keys: list[tuple]) -> list:
                reports = _prime(model, store, cache.namespace, [torch.tensor(key) for key in keys], input_ids.device,
                                 cache_keyword, takes_logits_to_keep)
                store.record_request([], replacing=reports)  # the batch counts the rows (report committed them)
                return reports

            for group in groups:
                for key, report in zip(group, run(group), strict=True):
                    lock = store.lookup(np.asarray(key), cache.namespace, count=False)
                    if lock[1].length < len(key) and len(group) > 1:  # a later row's admission evicted it: alone
                        store.release_lookup(*lock)
                        report = run([key])[0]
                        lock = store.lookup(np.asarray(key), cache.namespace, count=False)
                    cache.prime_locks.append(lock)
                    for b in todo[key]:
                        primed[b] = report
    except BaseException:
        release_primes(cache)
        raise
    cache.primed = primed


# Rows are primed together while their pads add at most this share to their tokens. On a CPU a forward costs about
# its tokens, pads included (measured: one forward over 8 rows with 75 % pads was slower than 8 on a ~0.5 B model).
# On a GPU a forward of a few hundred tokens costs its layers' launches more than its tokens: the rows of one cached
# prompt go in one forward, while no bucket computes more than twice its tokens at any length (a bound, unmeasured).
CPU_PRIME_PADDING = 0.25
DEVICE_PRIME_PADDING = 1.0


def prime_padding(device: torch.device) -> float:
    """The share of pads a batch of primes (or of sibling prefills) on `device` may add to its tokens."""
    return CPU_PRIME_PADDING if device.type == "cpu" else DEVICE_PRIME_PADDING


def _prime_groups(store, todo: dict[tuple, list[int]], peek, padding: float) -> list[list[tuple]]:
    """The primes to run together: those resuming at one depth (one column of a right-padded batch), where patched
    layers capture each row's states apart, in buckets padded by at most `padding` (prime_padding); one by one
    otherwise (transformers' layers capture by splitting the forward, at columns shared by every row)."""
    if not store.records_in_kernel:
        return [[key] for key in todo]
    tail = max(store.min_prefill_tokens, 1)  # (what begin leaves each row to compute: logits_to_keep=1)
    by_depth: dict[int, list[tuple]] = {}
    for key in todo:
        by_depth.setdefault(peek(torch.tensor(key[: len(key) - tail])), []).append(key)
    return [bucket for depth, keys in by_depth.items()
            for bucket in padded_buckets(keys, [len(key) - depth for key in keys], padding)]


def padded_buckets(items: list, lengths: list[int], padding: float | None) -> list[list]:
    """`items` in buckets, longest first, each padded to its longest: a bucket takes the next item while its
    padded tokens stay within (1 + padding) x its real tokens (`padding` None: one bucket)."""
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        bucket = buckets[-1] if buckets else None
        if bucket is not None and (padding is None or (len(bucket) + 1) * lengths[bucket[0]]
                                   <= (1 + padding) * (sum(lengths[j] for j in bucket) + lengths[i])):
            bucket.append(i)
        else:
            buckets.append([i])
    return [[items[i] for i in bucket] for bucket in buckets]


def _prime(model, store, namespace: str, rows: list[torch.Tensor], device, cache_keyword: str,
           takes_logits_to_keep: bool) -> list:
    """Prefill `rows` (token ids) through a new cache of `store`, several at once right-padded (each row's end
    state captured by the row's own column); returns each row's report."""
    from prefixlab.cache.hf import HybridPrefixCache

    prime = HybridPrefixCache(store, namespace)
    input_ids, mask = right_pad(rows)
    inputs = {"input_ids": input_ids.to(device)}
    if len(rows) > 1:
        prime.row_ends = [len(row) for row in rows]
        inputs["attention_mask"] = mask.to(device)
    extra = {"logits_to_keep": 1} if takes_logits_to_keep else {}  # only the states matter
    model(**inputs, use_cache=True, **{cache_keyword: prime}, **extra)
    return prime.report().rows


def release_primes(cache) -> None:
    """Unlock the primed states `prime_rows` held for `cache`'s first forward (after it looked them up)."""
    locks, cache.prime_locks = getattr(cache, "prime_locks", []), []
    for pair in locks:
        cache.store.release_lookup(*pair)
