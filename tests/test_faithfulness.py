"""Faithfulness to the public Marconi simulator on the LMSys trace (GPT-NeoX tokenizer, 1 session/s, marconi-7b),
and dp against marconi on the chat trace and on successive versions of system prompts.

Reference token hit rates (%) are what the public Marconi simulator reports on the same trace.
"""

import pytest
from conftest import require_shared

from prefixlab.cache.costmodel import ModelSpec
from prefixlab.sim.build import build_conversation_trace, build_shared_prefix_trace
from prefixlab.sim.replay import simulate

GB = 10**9
REFERENCE = {
    "vllm+": {1: 7.55, 2: 9.47, 5: 17.74},
    "sglang+": {1: 25.09, 2: 52.94, 5: 78.99},
    "marconi": {1: 26.65, 2: 54.28, 5: 82.53},
}

pytestmark = pytest.mark.data


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_name("marconi-7b")


@pytest.fixture(scope="module")
def lmsys():
    return build_conversation_trace(
        require_shared("traces/lmsys_chat_1000.jsonl"), require_shared("tokenizers/gpt-neox-20b.json"), 1.0
    )


@pytest.fixture(scope="module")
def lmsys_results(lmsys, spec):
    return {(p, gb): simulate(lmsys, p, gb * GB, spec).token_hit_rate for p in [*REFERENCE, "dp"] for gb in (1, 2, 5)}


@pytest.mark.parametrize("policy", ["vllm+", "sglang+"])
@pytest.mark.parametrize("gb", [1, 2, 5])
def test_baselines_match_the_marconi_simulator_within_two_points(lmsys_results, policy, gb):
    assert lmsys_results[policy, gb] == pytest.approx(REFERENCE[policy][gb], abs=2.0)


@pytest.mark.parametrize("gb", [1, 2, 5])
def test_marconi_is_at_least_the_reference_minus_one_point(lmsys_results, gb):
    assert lmsys_results["marconi", gb] >= REFERENCE["marconi"][gb] - 1.0


@pytest.mark.parametrize("gb", [1, 2, 5])
def test_dp_is_within_half_a_point_of_marconi_on_chat(lmsys_results, gb):
    # dp's bar (issue 9): >= the best other policy - 0.5 points. On chat its priced states rarely pay, and its
    # eviction differs from Marconi's only by thinning them; measured -0.13 / -0.09 / -0.03 points at 1 / 2 / 5 GB.
    assert lmsys_results["dp", gb] >= lmsys_results["marconi", gb] - 0.5


def test_dp_beats_marconi_on_system_prompt_versions(spec):
    trace = build_shared_prefix_trace(
        require_shared("system_prompts/system_prompts.jsonl"), require_shared("tokenizers/gpt-neox-20b.json"),
        num_requests=400,
    )
    marconi = simulate(trace, "marconi", 5 * GB, spec).token_hit_rate
    dp = simulate(trace, "dp", 5 * GB, spec).token_hit_rate
    assert dp >= marconi + 3.0, (dp, marconi)
