"""Policy names -> (admission, eviction) pairs. One registry serves the simulator and the real-model store.

| name               | admission                                   | eviction                      |
|--------------------|---------------------------------------------|-------------------------------|
| `vllm+`            | a state every block (32) and at the end     | LRU over blocks               |
| `sglang+`          | Marconi's (branch point, last token)        | LRU over leaves               |
| `marconi`          | Marconi's                                   | FLOP-aware, alpha tuned       |
| `dp`               | Marconi's + priced DP placement (priced.py) | FLOP-aware + thinning, tuned  |
| `marconi+balanced` | Marconi's + `budget` evenly spaced states   | FLOP-aware, alpha tuned       |
| `marconi+block`    | Marconi's + a state every 64 tokens         | FLOP-aware, alpha tuned       |
| `marconi+log`      | Marconi's + `budget` states, dense near end | FLOP-aware, alpha tuned       |

Placed checkpoints (dp, marconi+*) go only where the request computes anyway: strictly between the reused
length and the end of the admitted sequence. The heuristics place a fixed budget (default 4 states, so at most 6
with the branch point and the last token); dp has no fixed budget: each state is priced (prefixlab.cache.priced),
since one marconi-7b state is ~27 MB, the KV of ~400 tokens, and whether that pays depends on the workload.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixlab.cache.admission import (
    BlockAdmission,
    MarconiAdmission,
    PlacedAdmission,
    SGLangAdmission,
)
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.eviction import BlockLRU, EvictionPolicy, FlopAware, LeafLRU, ThinningFlopAware
from prefixlab.cache.tree import RadixTree
from prefixlab.errors import InvalidInputError

PLACEMENTS = ("balanced", "block", "log")
POLICY_NAMES = ("vllm+", "sglang+", "marconi", "dp", *(f"marconi+{p}" for p in PLACEMENTS))


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs shared by the policies: vLLM+'s block, the heuristics' per-entry budget and marconi+block's grid,
    and dp's law: its decay per request, its depth block and how often (requests) its DP is re-solved."""

    block_size: int = 32
    checkpoint_budget: int = 4
    placement_block: int = 64
    histogram_decay: float = 0.99
    law_block: int = 16
    resolve_every: int = 50
    capacity_bytes: int = 0  # the cache's budget (dp prices states by how full it is); 0: unknown, always full
    strict_budget: bool = False  # an entry that does not fit is cut (not kept whole over the budget: overflow)


def check_policy_name(name: object) -> str:
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise InvalidInputError(f"policy={name!r} is unknown; use one of {', '.join(POLICY_NAMES)}")
    return name


def tunes_alpha(name: str) -> bool:
    """Whether the policy evicts FLOP-aware (and so tunes alpha)."""
    return name not in ("vllm+", "sglang+")


def build_policy(
    name: str, tree: RadixTree, spec: ModelSpec, options: PolicyOptions, alpha: float
) -> tuple[MarconiAdmission, EvictionPolicy]:
    """The admission and eviction objects of policy `name` over `tree`."""
    check_policy_name(name)
    if name == "vllm+":
        return BlockAdmission(options.block_size), BlockLRU(tree, spec, options.block_size)
    if name == "sglang+":
        return SGLangAdmission(), LeafLRU(tree, spec, options.block_size)
    if name == "dp":
        from prefixlab.cache.priced import PricedAdmission

        admission = PricedAdmission(options.law_block, options.histogram_decay, options.resolve_every,
                                    spec.state_bytes / max(spec.kv_bytes_per_token, 1), tree, options.capacity_bytes,
                                    prior_states=options.checkpoint_budget,
                                    token_bytes=spec.kv_bytes_per_token if options.strict_budget else 0)
        eviction = ThinningFlopAware(tree, spec, options.block_size, alpha)
        eviction.link(admission)
        return admission, eviction
    eviction = FlopAware(tree, spec, options.block_size, alpha)
    if name == "marconi":
        return MarconiAdmission(), eviction
    return _placed_admission(name, options), eviction


def _placed_admission(name: str, options: PolicyOptions) -> PlacedAdmission:
    from prefixlab.cache import placement

    budget, block = options.checkpoint_budget, options.placement_block
    heuristics = {
        "balanced": lambda reused, length: placement.balanced_positions(length - 1, budget),
        "block": lambda reused, length: placement.block_positions(length - 1, block),
        "log": lambda reused, length: placement.log_positions(length - 1, budget),
    }
    return PlacedAdmission(heuristics[name.split("+")[1]])
