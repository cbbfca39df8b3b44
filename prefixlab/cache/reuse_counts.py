"""What a PrefixStore's requests reused and why (mixed into it): the per-sequence counts of `stats()`."""

from __future__ import annotations

from prefixlab.cache.explain import MISS_REASONS, REASONS
from prefixlab.cache.sharing import serialized


class ReuseCounts:
    """Mixed into PrefixStore (which gives it `lock` and `spec`): counts kept across `clear()`."""

    def _start_counts(self) -> None:
        self._counters = {"sequences": 0, "hit_sequences": 0, "reused_tokens": 0, "reused_bytes": 0,
                          "offload_hits": 0, "decoded_tokens_left_out": 0, "limited_tokens_left_out": 0}
        self._reasons = dict.fromkeys(REASONS, 0)

    @serialized
    def count_left_out(self, decoded: int, limited: int) -> None:
        """Count tokens a cache held but did not admit: `decoded` (decode_differs), `limited` (admit_limit)."""
        self._counters["decoded_tokens_left_out"] += decoded
        self._counters["limited_tokens_left_out"] += limited

    def _count_offload_hit(self) -> None:  # a lookup's host-tier match (PrefixStore.match_offloaded)
        self._counters["offload_hits"] += 1

    @serialized
    def record_request(self, rows: list, replacing: list = ()) -> None:
        """Count a request's rows (cache/explain.py RowReport: reused tokens, reason) in `stats()`; `replacing`: the
        rows this request was counted with before (it resumed further, mid-request)."""
        for row, sign in (*((r, -1) for r in replacing), *((r, 1) for r in rows)):
            self._counters["sequences"] += sign
            self._counters["hit_sequences"] += sign if row.reused else 0
            self._counters["offload_hits"] += sign if row.reused and row.from_host else 0
            self._counters["reused_tokens"] += sign * row.reused
            self._counters["reused_bytes"] += sign * (row.reused * self.spec.kv_bytes_per_token
                                                      + (self.spec.state_bytes if row.reused else 0))
            self._reasons[row.reason] += sign

    def _counted(self) -> dict:
        """The counts as `stats()` reports them: the counters, `reasons` and `miss_reasons` (all but "hit")."""
        reasons = dict(self._reasons)
        return {**self._counters, "reasons": reasons,
                "miss_reasons": {reason: reasons[reason] for reason in MISS_REASONS}}
