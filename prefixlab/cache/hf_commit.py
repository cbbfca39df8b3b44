"""How HybridPrefixCache admits what it holds (mixed into it): each admitted row's real tokens, without its pads, with
its KV and the states captured up to where it may be admitted. The store commits a cache before its next lookup (or
you do); the request state read and written is HybridPrefixCache's (hf.py)."""

from __future__ import annotations

from prefixlab.cache.sharing import under_store_lock
from prefixlab.cache.tensors import check_held_states, row_kv, row_states, snapshot_states


class RequestCommit:
    """Mixed into HybridPrefixCache: `commit` and what the store asks before it."""

    def only_decoded_since_commit(self) -> bool:
        """Whether all this cache holds past its last commit is decode steps of a generate() call still running:
        another request's lookup leaves it (a state per lookup per decoding request would pile up); it is admitted
        on the store's first use after the call."""
        return self.generate_prompt is not None and self._committed >= self.generate_prompt

    @under_store_lock
    def commit(self) -> int:
        """Admit the sequences this cache holds (prompt + output fed so far) with the captured and final states.
        Idempotent; returns the number of tokens newly offered to the store. A forward in flight (in another thread)
        is never committed: the cache is committed between its forwards."""
        if not self._started or self._pending or not self._admit_rows:
            return 0
        if self._mask_plain is not None:  # rows a one-token forward fed a pad or masked otherwise (one device sync)
            plain = self._mask_plain.tolist()
            self._admit_rows, self._mask_plain = [row for row in self._admit_rows if plain[row]], None
            if not self._admit_rows:
                self._report.admission = "not admitted (refused input)"
                self.store.drop(self)
                return 0
        if self._generation != self.store.generation:  # the store was cleared since: maybe other weights' tensors
            if not self._committed:
                self._report.admission = "not admitted (the store was cleared after the request began)"
            return 0
        differed = any(bool(flag) for flag in self._decode_differs.values())  # one device sync per device
        decoded = self._seen if self._decode_start is None or not differed else self._decode_start
        if not differed:  # decode steps so far computed as prefills: a later turn's decode steps start their own span
            self._decode_start, self._decode_differs = None, {}
        end = min(decoded, self._admit_limit)
        report, rows = self._report, len(self._admit_rows)  # (counted once: a later commit adds what is new)
        self.store.count_left_out((self._seen - decoded - report.decoded_left_out) * rows,
                                  (decoded - end - report.limited_left_out) * rows)
        report.leave_out(self._seen - decoded, decoded - end)
        if end <= self._committed:
            return 0
        tokens = self.held_tokens()
        if tokens.shape[1] != self._seen:  # tokens fed outside the hooks: we cannot say what the tensors hold
            return 0
        snapshots = {p: snap for p, snap in self._captured.items() if p <= end}
        if end == self._seen and self.row_ends is None:
            snapshots[end] = snapshot_states(self.layers, self.store.layout.state_layers)
        for row in self._admit_rows:
            pad = self._pads[row]  # real position = column - pad; states at or before the first real token unused
            stop = end if self.row_ends is None else min(end, self.row_ends[row])
            if stop <= pad:
                continue
            states = row_states(snapshots, self._row_captured, row, pad, stop)
            check_held_states(states, self.store.layout)
            kv = row_kv(self.layers, self.store.layout, row, pad)
            self._report.add_admission(self.store._admit(tokens[row, pad:stop].numpy(), kv, states, self.namespace,
                                                          computed=True))
        offered = end - self._committed
        self._committed = end
        return offered

