"""How HybridPrefixCache resumes a batch's rows (mixed into it): each row looked up on its real tokens, the rows
aligned on one padded column (rows.one_column), their KV and states loaded there, and the captures after it planned.
The request state it reads and writes is HybridPrefixCache's (hf.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from prefixlab.cache.devices import layer_devices
from prefixlab.cache.explain import RowReport
from prefixlab.cache.rows import load_rows, one_column


class RowResume:
    """Mixed into HybridPrefixCache: `_resume` and the row lookups it makes."""

    def _resume(self, ids: torch.Tensor, tail: int, held: int) -> tuple[int, list[RowReport], list[int]]:
        """Look up every row of `ids` [batch, length] (all but its last `tail` columns), align the rows on one
        column and, if deeper than the `held` columns, load the store's KV and states there; plan the captures
        after it. Returns (the column the cache holds now, the rows' reports, each row's reused tokens)."""
        length, pads = ids.shape[1], self._pads
        ends = self.row_ends or [length] * len(pads)  # (right padding: each row's tokens end at its own column)
        # row b's real tokens; resuming at padded column c means resuming row b at real position c - pads[b], and
        # c <= end - tail leaves every row the tokens it must compute (store.min_prefill_tokens)
        probes = [ids[row, pad: end - tail].numpy() for row, (pad, end) in enumerate(zip(pads, ends, strict=True))]
        found: list[tuple] = []  # per row: (device match, the match to load from), all locked
        try:
            for probe in probes:  # one by one: `found` holds every lock taken, for the finally below
                found.append(self._lookup(probe))
            rows = [self._row_report(max(end - pad, 0), probe, *pair)
                    for pad, end, probe, pair in zip(pads, ends, probes, found, strict=True)]

            def deepest(row: int, limit: int) -> int:  # re-matched there (a row at 0 starts fresh: only pads before)
                pair, found[row] = found[row], None
                self.store.release_lookup(*pair)
                found[row] = self._lookup(probes[row][:limit])
                return found[row][1].length

            rows_reused = one_column([source.length for _, source in found], pads, deepest)
            common = min(pad + reused for pad, reused in zip(pads, rows_reused, strict=True))
            if not any(rows_reused):
                common = 0
            common = max(common, held)
            # a continuing forward plans over the tokens so far, replacing what earlier forwards planned past them;
            # their end is not the request's (the state at the request's end is taken at commit): not planned
            plans = [{pads[row] + p for p in self.store.plan(ids[row, pads[row]:ends[row]].numpy(), match)}
                     if pads[row] < ends[row] else set() for row, (match, _) in enumerate(found)]
            if self.row_ends is not None:  # (one forward) each row captures its own plan and its end's state alone
                self._row_plans = [sorted(p for p in plan | {end} if common < p <= end)
                                   for plan, end in zip(plans, ends, strict=True)]
                plans = []
            planned = set().union(*plans) - ({length} if held else set())
            if self.store.admit_limit < length:  # (a DSA model) where later requests resume: its state is kept
                planned.add(int(self.store.admit_limit))
            self._plan = sorted(p for p in planned if common < p <= self._admit_limit)  # (none past an image)
            if held:  # what an earlier forward placed over a shorter part of the prompt and this plan drops: dropped
                for position in self._provisional - planned:
                    self._captured.pop(position, None)
                self._provisional = (self._provisional & planned) | set(self._plan)
            if common > held:
                load_rows(self.layers, self.store.layout, common, [source for _, source in found],
                          layer_devices(self.store.model, self.store.walk), self.store.device)
        finally:
            for pair in filter(None, found):
                self.store.release_lookup(*pair)
        primed = self.primed if not held and self.primed else [None] * len(rows)
        for i, ((match, source), prime) in enumerate(zip(found, primed, strict=True)):
            rows[i].from_host = bool(rows_reused[i]) and source is not match
            if prime is not None:  # prefilled alone first (align.py): what the store held then, not what it computed
                rows[i], rows_reused[i] = replace(prime, prompt_tokens=rows[i].prompt_tokens), min(rows_reused[i],
                                                                                                  prime.reused)
            rows[i].reused = rows_reused[i]
            if rows_reused[i] < rows[i].checkpoint:
                rows[i].reason = "batch_alignment"
        return common, rows, rows_reused

    def _row_report(self, prompt_tokens: int, probe, match, source) -> RowReport:
        """A row's report before batch alignment: what the store shares and why it reuses no more."""
        if prompt_tokens < 2:
            return RowReport(prompt_tokens, reason="too_short")
        return RowReport(prompt_tokens, shared=max(match.shared_length, source.shared_length),
                         checkpoint=source.length, reason=self.store.explain(probe, source),
                         from_host=source is not match)

    def _lookup(self, probe) -> tuple:  # (rows loaded from the host are counted by record_request)
        return self.store.lookup(probe, self.namespace, count=False)

