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

from collections.abc import Container, Iterable, Mapping
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
    is_weighted = weighted.ids()
    # min-max normalisation over the candidates' recency terms (a weighted leaf's is weight / age): affine, so the
    # offset is dropped and only the scale kept (all-equal terms normalise to one constant, as in Marconi)
    terms = [1.0 / (now - row[0]) for row in (_unweighted(by_recency, is_weighted),
                                              _unweighted(reversed(by_recency), is_weighted)) if row is not None]
    if is_weighted:
        terms += (weight / (now - weighted.first()[0]), weight / (now - weighted.last()[0]))
    low, high = min(terms), max(terms)
    recency_scale = 1.0 / (high - low) if high > low else 0.0
    leaf_scale = recency_scale * weight
    eff_low, eff_high = by_efficiency.first()[0], by_efficiency.last()[0]
    eff_scale = alpha / (eff_high - eff_low) if eff_high > eff_low else 0.0

    best_score, best_id, seen = INF, None, {None}  # None: no leaf row
    seen_add = seen.add
    leaf_rows, leaf_bound = iter(weighted), 0.0  # leaf_bound: the least an unseen weighted leaf's recency term can be
    for (last_access, _, old_id), (eff, inefficient_id) in zip(by_recency, by_efficiency, strict=True):
        leaf_id = None
        if leaf_bound != INF:
            leaf = next(leaf_rows, None)
            if leaf is None:
                leaf_bound = INF  # every weighted leaf was seen
            else:
                leaf_bound, leaf_id = leaf_scale / (now - leaf[0]), leaf[-1]
        for node_id in (old_id, leaf_id, inefficient_id):
            if node_id in seen:
                continue
            seen_add(node_id)
            node = nodes[node_id]
            if node.lock_count == 0:
                score = ((leaf_scale if node_id in is_weighted else recency_scale) / (now - node.last_access)
                         + efficiency[node_id] * eff_scale)
                if score < best_score:
                    best_score, best_id = score, node_id
        # an unseen candidate is a weighted leaf (no more recent than the leaf row) or another one (no more recent
        # than the row of all candidates), and no more efficient than the efficiency row
        bound = recency_scale / (now - last_access)
        if best_score <= (leaf_bound if leaf_bound <= bound else bound) + eff * eff_scale:  # min(), without a call
            break
    return best_id


def _unweighted(rows: Iterable[tuple], weighted: Container[int]) -> tuple | None:
    """The first of `rows` that is not weighted (weighted leaves are evicted early: few are skipped)."""
    for row in rows:
        if row[-1] not in weighted:
            return row
    return None
