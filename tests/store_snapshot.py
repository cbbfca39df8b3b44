"""Everything observable about a PrefixStore, to compare before and after a refused call: both tiers' entries
(tokens, namespace, checkpoint positions, digests of every KV and state tensor: persist_helpers.contents), every
node's bookkeeping, the policy cores' counters, alpha, bootstrap record and the eviction / admission indexes' sizes,
the store's per-sequence counts, open caches and generation, and the model's hooks and patch flag."""

from __future__ import annotations

from persist_helpers import contents, model_state


def _sizes(policy) -> dict:
    """A policy object's state: its numbers as they are, its containers (indexes, maps) by size."""
    found = {}
    for name, value in sorted(vars(policy).items()):
        if isinstance(value, bool | int | float | str | type(None)):
            found[name] = value
        elif hasattr(value, "__len__"):
            found[name] = len(value)
    return found


def _bootstrap(core):
    boot = core.bootstrap
    if boot is None:
        return None
    return (len(boot.requests), boot.held, boot.dropped, boot.tune_at, boot.provisional_done, boot.tied,
            boot.pending is not None)


def _nodes(core) -> list:
    return sorted((node.namespace, node.start, tuple(node.tokens.tolist()), tuple(node.ckpt_pos), node.last_access,
                   node.lock_count, node.branched, node.truncated, node.resumed, node.recent_resumes,
                   node.resumed_at) for node in core.tree.nodes() if not node.is_root)


def tier(core, tensors: bool = True) -> dict:
    """One policy core; `tensors`: its payloads are tensors (a store's), digested (else the simulator's sizes)."""
    stats = {k: v for k, v in core.stats().items() if not k.startswith("tuning_")}  # (wall times)
    return {"contents": contents(core) if tensors else None, "nodes": _nodes(core), "stats": stats, "clock": core.clock,
            "bootstrap": _bootstrap(core), "eviction": _sizes(core.eviction), "admission": _sizes(core.admission),
            "live": len(core._live), "evicted_log": len(core.evicted or ())}


def snapshot(store) -> dict:
    """The store as a plain dict (without flushing: open caches are part of it, by id)."""
    with store.lock:
        return {"device": tier(store.core), "host": tier(store.offload) if store.offload is not None else None,
                "counts": store._counted(), "open": sorted(store._open), "host_matches": len(store._host_matches),
                "generation": store.generation, "closed": store.closed, "weights": store.weights,
                "model": model_state(store.model)}


def diff(before: dict, after: dict) -> list:
    """The top-level parts (and tier parts) that differ, for an assertion message."""
    changed = []
    for key in before:
        if before[key] == after[key]:
            continue
        if isinstance(before[key], dict) and isinstance(after[key], dict):
            changed += [f"{key}.{k}" for k in before[key] if before[key][k] != after[key].get(k)]
        else:
            changed.append(key)
    return changed
