"""dp's eviction pick: Marconi's utility, with an entry leaf's recency weighed like its efficiency.

Marconi scores a candidate S = recency + alpha * flop_efficiency, recency = 1 / (now - last access), both terms
min-max normalised over the candidates. dp weighs an entry's leaf (without in-edge states) by how likely it is
resumed from relative to any stored node (`EntryLaw.leaf_weight`): its FLOP efficiency is indexed times the weight
already (ThinningFlopAware), and its recency is weight / (now - last access) here, before the normalisation.
Recency stands for how likely a hit is; a leaf that the law says is resumed from 40 times less often than stored
nodes is not made likely by being recent. Without this, the weight does nothing when alpha is 0 (plain LRU),
which a small cache's short tuning window often picks.

A branch point requests keep resuming from has its recency term times a boost > 1 (`boost`: 1 + ln(its recent
resumes), ThinningFlopAware): recency alone says a prompt resumed from a hundred times lately is as likely to be
used again as a one-off entry admitted at the same time, and in a small cache a burst of one-off entries evicts it.

The argmin is a threshold scan, as FlopAware.pick's, over three sorted indexes: all candidates by age, the
weighted leaves by age, all candidates by efficiency; it stops once no unseen candidate can score lower (a boost
only raises a score, so the rows' bounds hold).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

INF = float("inf")
FORGOTTEN_RESUMES = 1e-3  # a branch point's decayed resumes below this are dropped (its boost was 1 long before)
LOG_FORGOTTEN_RESUMES = math.log(FORGOTTEN_RESUMES)

if TYPE_CHECKING:
    from prefixlab.cache.sorted_index import SortedIndex
    from prefixlab.cache.tree import Node


def pick_weighted(now: int, nodes: Mapping[int, Node], by_recency: SortedIndex, weighted: SortedIndex, weight: float,
                  by_efficiency: SortedIndex, efficiency: Mapping[int, float], alpha: float,
                  boost: Mapping[int, float] | None = None) -> int | None:
    """The id of the unlocked candidate of least utility, or None.

    `by_recency`: (last_access, tie, id) rows of every candidate, oldest first; `weighted`: the same rows of the
    candidates whose recency is scaled by `weight`; `by_efficiency`: (efficiency, id) rows of every candidate,
    least first (efficiencies weighted already); `nodes`: every candidate by id; `boost`: the candidates whose
    recency term is also multiplied by a factor >= 1, and that factor."""
    now = max(now, by_recency.last()[0] + 1)  # ages >= 1 (core picks after its clock moved; a direct call may not)
    is_weighted, boost = weighted.ids(), boost or {}
    # min-max normalisation over the candidates' recency terms (a weighted leaf's is weight / age, a boosted one's
    # times its boost): affine, so the offset is dropped and only the scale kept (all-equal terms normalise to one
    # constant, as in Marconi). The boosted terms are taken one by one, the others' extremes at the ends of their
    # index (plain candidates: all but the weighted leaves), skipping the boosted (few: few are skipped).
    terms = [(weight if node_id in is_weighted else 1.0) * factor / (now - nodes[node_id].last_access)
             for node_id, factor in boost.items()]
    for rows, coefficient, skipped in ((by_recency, 1.0, is_weighted), (weighted, weight, ())):
        for ordered in (rows, reversed(rows)):
            for last_access, _, node_id in ordered:
                if node_id not in skipped and node_id not in boost:
                    terms.append(coefficient / (now - last_access))
                    break
    low, high = min(terms), max(terms)
    recency_scale = 1.0 / (high - low) if high > low else 0.0
    leaf_scale = recency_scale * weight
    eff_low, eff_high = by_efficiency.first()[0], by_efficiency.last()[0]
    eff_scale = alpha / (eff_high - eff_low) if eff_high > eff_low else 0.0

    best_score, best_id, seen = INF, None, set()
    seen_add = seen.add
    leaf_rows, leaf_bound = iter(weighted), 0.0  # leaf_bound: the least an unseen weighted leaf's recency term can be
    # Row by row: the next oldest candidate, the next oldest weighted leaf, the next least efficient candidate, each
    # scored unless seen (unrolled: each takes what its row holds, its last access or its efficiency, from the row;
    # the indexes are kept current, so a row's key is its node's)
    for (last_access, _, old_id), (eff, inefficient_id) in zip(by_recency, by_efficiency, strict=True):
        if old_id not in seen:
            seen_add(old_id)
            if nodes[old_id].lock_count == 0:
                score = ((leaf_scale if old_id in is_weighted else recency_scale) * boost.get(old_id, 1.0)
                         / (now - last_access) + efficiency[old_id] * eff_scale)
                if score < best_score:
                    best_score, best_id = score, old_id
        if leaf_bound != INF:
            leaf = next(leaf_rows, None)
            if leaf is None:
                leaf_bound = INF  # every weighted leaf was seen
            else:
                leaf_access, _, leaf_id = leaf
                leaf_bound = leaf_scale / (now - leaf_access)
                if leaf_id not in seen:
                    seen_add(leaf_id)
                    if nodes[leaf_id].lock_count == 0:
                        score = (leaf_scale * boost.get(leaf_id, 1.0) / (now - leaf_access)
                                 + efficiency[leaf_id] * eff_scale)
                        if score < best_score:
                            best_score, best_id = score, leaf_id
        if inefficient_id not in seen:
            seen_add(inefficient_id)
            node = nodes[inefficient_id]
            if node.lock_count == 0:
                score = ((leaf_scale if inefficient_id in is_weighted else recency_scale)
                         * boost.get(inefficient_id, 1.0) / (now - node.last_access) + eff * eff_scale)
                if score < best_score:
                    best_score, best_id = score, inefficient_id
        # an unseen candidate is a weighted leaf (no more recent than the leaf row) or another one (no more recent
        # than the row of all candidates), and no more efficient than the efficiency row
        bound = recency_scale / (now - last_access)
        if best_score <= (leaf_bound if leaf_bound <= bound else bound) + eff * eff_scale:  # min(), without a call
            break
    return best_id


def resume_boosts(boosted: Mapping[int, float], elapsed_log: float) -> tuple[dict[int, float], list[int]]:
    """The recency factors of the candidates resumed from more than once lately, 1 + ln(recent resumes), and the
    candidates whose resumes decayed below FORGOTTEN_RESUMES (to forget). `boosted`: each candidate with recent
    resumes and ln(its resumes decayed back to clock 0); `elapsed_log`: ln of the decay from clock 0 to now. One
    resume is no evidence (a chat's next turn resumes once from the split its own history made)."""
    boosts, forgotten = {}, []
    for node_id, log_at_zero in boosted.items():
        log_resumes = log_at_zero - elapsed_log
        if log_resumes > 0.0:
            boosts[node_id] = 1.0 + log_resumes
        elif log_resumes < LOG_FORGOTTEN_RESUMES:
            forgotten.append(node_id)
    return boosts, forgotten
