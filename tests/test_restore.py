"""A core rebuilt from its saved policy state (cache/restore.py) serves on exactly as the saved one would, model-free;
a damaged state is refused."""

import copy
import json
import math

import pytest

from prefixlab.cache.alpha import settle_alpha, settled_alpha
from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.costmodel import ModelSpec
from prefixlab.cache.replay import replay_as_store
from prefixlab.cache.restore import check_policy_state, policy_state, preorder, rebuild, restarted, sized_nodes
from prefixlab.errors import InvalidInputError
from prefixlab.sim.workloads import agentic_trace, few_shot_trace

SPEC = ModelSpec.from_name("marconi-7b")
CAPACITY = 1_200_000_000  # both traces evict and tune alpha in their first half at this budget


def served(core, requests) -> list[int]:
    return [replay_as_store(core, r.tokens, len(r.input_tokens)) for r in requests]


def saved(core) -> tuple[list, dict]:
    """The core's nodes and policy state as a file holds them (through JSON)."""
    nodes = list(preorder(core.tree))
    return sized_nodes(nodes, SPEC), json.loads(json.dumps(policy_state(core, nodes)))


def rebuilt(core, policy="dp", state=None) -> PrefixCacheCore:
    nodes, saved_state = saved(core)
    check_policy_state(saved_state if state is None else state, len(nodes))
    fresh = PrefixCacheCore(core.capacity_bytes, policy, SPEC, core.options.block_size)
    settle_alpha(fresh, settled_alpha(core))
    rebuild(fresh, nodes, saved_state if state is None else state)
    fresh.check_invariants()
    return fresh


def shape(core) -> list[tuple]:
    return [(n.id, n.namespace, n.start, n.end, n.ckpt_pos, n.last_access, n.recent_resumes)
            for n in preorder(core.tree)]


@pytest.fixture(scope="module", params=["few-shot", "agentic"])
def halfway(request):
    """A dp core after the first half of a trace (tuned, evicting), the first half and the second."""
    requests = few_shot_trace(num_requests=300) if request.param == "few-shot" else agentic_trace(num_sessions=12)
    core, half = PrefixCacheCore(CAPACITY, "dp", SPEC, 32), len(requests) // 2
    served(core, requests[:half])
    assert core.bootstrap is None and core.evictions > 0
    assert any(law.interior > 0 for law in core.admission.laws.values())  # (a law learned: what is saved)
    return core, requests[:half], requests[half:]


@pytest.mark.parametrize("policy", ["dp", "marconi", "sglang+", "vllm+"])
def test_a_rebuilt_core_serves_on_exactly_as_the_saved_one(halfway, policy):
    core, first, later = halfway
    if policy != "dp":  # the same first half under this policy
        core = PrefixCacheCore(CAPACITY, policy, SPEC, 32)
        served(core, first)
        assert core.evictions > 0 and core.bootstrap is None
    twin = restarted(core)
    twin.check_invariants()
    assert shape(twin) == shape(core)
    original = core.fork()  # (the module's core stays at the halfway point)
    assert served(twin, later) == served(original, later)
    assert shape(twin) == shape(original) and twin.alpha == original.alpha


def test_without_the_saved_policy_state_the_continuation_differs(halfway):
    """(What the test above checks is not trivially true: the same tree with a fresh law serves otherwise.)"""
    core, _, later = halfway
    state = saved(core)[1]
    state["admission"] = PrefixCacheCore(CAPACITY, "dp", SPEC, 32).admission.state(set())
    assert served(rebuilt(core, state=state), later) != served(core.fork(), later)


def test_no_policy_state_while_alpha_is_still_to_be_tuned():
    core = PrefixCacheCore(100 * CAPACITY, "dp", SPEC, 32)
    served(core, few_shot_trace(num_requests=3))
    assert core.bootstrap is not None and policy_state(core, list(preorder(core.tree))) is None
    with pytest.raises(InvalidInputError, match="still tuning alpha"):
        restarted(core)


DAMAGES = {
    "version": lambda s: s.update(version=2),
    "clock": lambda s: s.update(clock=-1),
    "a clock past any float": lambda s: s.update(clock=10**400),  # (accepted, then every request: OverflowError)
    "a last access after the clock": lambda s: s["nodes"][0].__setitem__(0, s["clock"] + 1),
    "a node too few": lambda s: s["nodes"].pop(),
    "a NaN efficiency": lambda s: s["nodes"][0].__setitem__(3, math.nan),
    "a cached efficiency's shape without its leaf flag": lambda s: s["nodes"][0].__setitem__(3, [0, 4, 1, 4, 0.5]),
    "negative resumes": lambda s: s["nodes"][0].__setitem__(1, -1.0),
    "leaf weight": lambda s: s.update(leaf_weight=1.5),
    "next id": lambda s: s.update(next_id=0),
    "a negative count in a law": lambda s: s["admission"]["laws"]["branch"]["histogram"].__setitem__(
        slice(1, None), [[0], [-1.0]]),
    "a law of another depth": lambda s: s["admission"]["laws"]["branch"]["histogram"].__setitem__(0, 7),
    "a law totals": lambda s: s["admission"]["law"]["totals"].pop(),
    "a kind of a node not saved": lambda s: s["admission"]["kinds"].append([10**9, "branch"]),
    "an unknown kind": lambda s: s["admission"]["kinds"][0].__setitem__(1, "sideways"),
    "a stint shape": lambda s: s["admission"]["stint_shapes"][0].__setitem__(1, 7),
    "no laws": lambda s: s["admission"].pop("end_laws"),
    "an admission state for marconi": lambda s: None,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_policy_state_is_refused(halfway, damage):
    core = halfway[0]
    state = copy.deepcopy(saved(core)[1])
    assert state["admission"]["kinds"] and state["admission"]["stint_shapes"]  # (what the damages change)
    DAMAGES[damage](state)
    with pytest.raises((ValueError, KeyError, TypeError)):
        rebuilt(core, "marconi" if damage == "an admission state for marconi" else "dp", state)
