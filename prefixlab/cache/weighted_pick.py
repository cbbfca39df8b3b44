"""dp's eviction pick: Marconi's utility, with an entry leaf's recency weighed like its efficiency.

Marconi scores a candidate S = recency + alpha * flop_efficiency, recency = 1 / (now - last access), both terms
min-max normalised over the candidates. dp weighs an entry's leaf (without in-edge states) by how likely it is
resumed from relative to any stored node (`EntryLaw.leaf_weight`): its FLOP efficiency is indexed times the weight
already (ThinningFlopAware), and its recency is weight / (now - last access) here, before the normalisation.
Recency stands for how likely a hit is; a leaf that the law says is resumed from 40 times less often than stored
nodes is not made likely by being recent. Without this, the weight does nothing when alpha is 0 (plain LRU),
which a small cache's short tuning window often picks.

The argmin is a threshold scan, as FlopAware.pick's, over three sorted indexes: all candidates by age, the
weighted leaves by age, all candidates by efficiency; it stops once no unseen candidate can score lower.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

INF = float("inf")

if TYPE_CHECKING:
    from prefixlab.cache.sorted_index import SortedIndex
    from prefixlab.cache.tree import Node


def pick_weighted(now: int, nodes: Mapping[int, Node], by_recency: SortedIndex, weighted: SortedIndex, weight: float,
                  by_efficiency: SortedIndex, efficiency: Mapping[int, float], alpha: float) -> int | None:
    """The id of the unlocked candidate of least utility, or None.

    `by_recency`: (last_access, tie, id) rows of every candidate, oldest first; `weighted`: the same rows of the
    candidates whose recency is scaled by `weight`; `by_efficiency`: (efficiency, id) rows of every candidate,
    least first (efficiencies weighted already); `nodes`: every candidate by id."""
    now = max(now, by_recency.last()[0] + 1)  # ages >= 1 (core picks after its clock moved; a direct call may not)
    # min-max normalisation over the candidates' recency terms (a weighted leaf's is weight / age): affine, so the
    # offset is dropped and only the scale kept (all-equal terms normalise to one constant, as in Marconi)
    oldest, newest = _unweighted(by_recency, weighted), _unweighted(reversed(by_recency), weighted)
    terms = [1.0 / (now - row[0]) for row in (oldest, newest) if row is not None]
    terms += [weight / (now - row[0]) for row in (weighted.first(), weighted.last())] if len(weighted) else []
    recency_scale = 1.0 / (max(terms) - min(terms)) if max(terms) > min(terms) else 0.0
    leaf_scale = recency_scale * weight
    eff_low, eff_high = by_efficiency.first()[0], by_efficiency.last()[0]
    eff_scale = alpha / (eff_high - eff_low) if eff_high > eff_low else 0.0

    best = [INF, None]  # score, id
    seen: set[int] = set()
    is_weighted = weighted.ids()

    def consider(node_id: int, last_access: int, eff: float) -> None:
        seen.add(node_id)
        if nodes[node_id].lock_count == 0:
            score = (leaf_scale if node_id in is_weighted else recency_scale) / (now - last_access) + eff * eff_scale
            if score < best[0]:
                best[:] = score, node_id

    leaf_rows, leaf_bound = iter(weighted), 0.0  # leaf_bound: the least an unseen weighted leaf's recency term can be
    for (last_access, _, old_id), (eff, inefficient_id) in zip(by_recency, by_efficiency, strict=True):
        if old_id not in seen:
            consider(old_id, last_access, efficiency[old_id])
        if leaf_bound != INF:
            row = next(leaf_rows, None)
            if row is None:
                leaf_bound = INF  # every weighted leaf was seen
            else:
                leaf_bound = leaf_scale / (now - row[0])
                if row[-1] not in seen:
                    consider(row[-1], row[0], efficiency[row[-1]])
        if inefficient_id not in seen:
            consider(inefficient_id, nodes[inefficient_id].last_access, eff)
        # an unseen candidate is a weighted leaf (no more recent than the leaf row) or another one (no more recent
        # than the row of all candidates), and no more efficient than the efficiency row
        if best[0] <= min(leaf_bound, recency_scale / (now - last_access)) + eff * eff_scale:
            break
    return best[1]


def _unweighted(rows: Iterable[tuple], weighted: SortedIndex) -> tuple | None:
    """The first of `rows` that is not weighted (weighted leaves are evicted early: few are skipped)."""
    ids = weighted.ids()
    return next((row for row in rows if row[-1] not in ids), None)
