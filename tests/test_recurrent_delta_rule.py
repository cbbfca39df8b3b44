"""gated_delta_rule: exact states at any position, resume == full run, and agreement with transformers' kernels."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.recurrent import _chunks, gated_delta_rule
from prefixlab.recurrent.hf_reference import hf_chunk_gated_delta_rule, hf_chunk_kda, hf_recurrent_gated_delta_rule
from prefixlab.recurrent.inputs import delta_rule_inputs, random_state

ATOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def tokens(inputs: dict, start: int, stop: int) -> dict:
    return {name: inputs[name][:, start:stop] for name in NAMES}


@st.composite
def delta_cases(draw):
    chunk_size = draw(st.sampled_from([4, 8, 16]))
    length = draw(st.integers(1, 3 * chunk_size + 3))
    heads_k, heads_v = draw(st.sampled_from([(1, 1), (2, 2), (1, 3), (2, 4)]))
    positions = sorted(draw(st.sets(st.integers(0, length), max_size=4)))
    return {
        "chunk_size": chunk_size,
        "length": length,
        "heads": (heads_k, heads_v),
        "positions": tuple(positions),
        "with_state": draw(st.booleans()),
        "per_channel": draw(st.booleans()),
        "backend": draw(st.sampled_from(["torch", "naive"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None)
@given(delta_cases())
def test_captured_states_are_prefix_final_states_and_resume_exactly(case):
    heads_k, heads_v = case["heads"]
    inputs = delta_rule_inputs(2, case["length"], heads_k, heads_v, 8, 6, per_channel_decay=case["per_channel"],
                               seed=case["seed"])  # fmt: skip
    initial = random_state(2, heads_v, 8, 6, seed=case["seed"]) if case["with_state"] else None
    common = {"chunk_size": case["chunk_size"], "use_qk_l2norm": True, "backend": case["backend"]}
    o, final, captured = gated_delta_rule(**inputs, initial_state=initial, capture=case["positions"], **common)

    assert sorted(captured) == list(case["positions"])
    for p, state in captured.items():
        assert state.dtype == torch.float32 and state.shape == final.shape
        _, prefix_final, _ = gated_delta_rule(**tokens(inputs, 0, p), initial_state=initial, **common)
        assert max_diff(state, prefix_final) <= ATOL, f"state at {p}"
        o_tail, final_tail, _ = gated_delta_rule(**tokens(inputs, p, case["length"]), initial_state=state, **common)
        assert max_diff(o_tail, o[:, p:]) <= ATOL, f"resume from {p}"
        assert max_diff(final_tail, final) <= ATOL, f"final after resuming from {p}"


@settings(max_examples=15, deadline=None)
@given(delta_cases())
def test_chunked_matches_token_by_token_reference(case):
    heads_k, heads_v = case["heads"]
    inputs = delta_rule_inputs(1, case["length"], heads_k, heads_v, 8, 4, per_channel_decay=case["per_channel"],
                               seed=case["seed"])  # fmt: skip
    initial = random_state(1, heads_v, 8, 4, seed=case["seed"]) if case["with_state"] else None
    runs = {
        backend: gated_delta_rule(**inputs, initial_state=initial, capture=case["positions"],
                                  chunk_size=case["chunk_size"], use_qk_l2norm=True, backend=backend)  # fmt: skip
        for backend in ("naive", "torch")
    }
    (o_ref, final_ref, states_ref), (o, final, states) = runs["naive"], runs["torch"]
    assert max_diff(o, o_ref) <= ATOL and max_diff(final, final_ref) <= ATOL
    assert all(max_diff(states[p], states_ref[p]) <= ATOL for p in case["positions"])


@pytest.mark.parametrize("heads", [(4, 4), (2, 4), (1, 3)])
@pytest.mark.parametrize("length,chunk_size", [(50, 16), (64, 64), (7, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers_torch_chunk_gated_delta_rule(heads, length, chunk_size, with_state):
    heads_k, heads_v = heads
    inputs = delta_rule_inputs(2, length, heads_k, heads_v, 16, 8, seed=length)
    initial = random_state(2, heads_v, 16, 8) if with_state else None
    q, k, v, g, beta = (inputs[name] for name in NAMES)
    o_ref, final_ref = hf_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=chunk_size,
                                                 initial_state=initial, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
    o_rec, final_rec = hf_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    for backend, (o_expected, final_expected) in {"torch": (o_ref, final_ref), "naive": (o_rec, final_rec)}.items():
        o, final, _ = gated_delta_rule(**inputs, initial_state=initial, chunk_size=chunk_size, use_qk_l2norm=True,
                                       backend=backend)  # fmt: skip
        assert max_diff(o, o_expected) <= ATOL and max_diff(final, final_expected) <= ATOL, backend


def test_kda_per_channel_decay_matches_transformers_kimi_linear():
    inputs = delta_rule_inputs(1, 40, 3, 3, 8, 8, per_channel_decay=True, seed=3)
    initial = random_state(1, 3, 8, 8)
    q, k, v, g, beta = (inputs[name] for name in NAMES)
    o_ref, final_ref = hf_chunk_kda(q, k, v, g, beta, chunk_size=16, initial_state=initial, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)  # fmt: skip
    o, final, _ = gated_delta_rule(**inputs, initial_state=initial, chunk_size=16, use_qk_l2norm=True, backend="torch")
    assert max_diff(o, o_ref) <= ATOL and max_diff(final, final_ref) <= ATOL


def test_scale_and_no_l2norm_follow_the_recurrence():
    inputs = delta_rule_inputs(1, 9, 2, 2, 4, 4, seed=5)
    inputs["k"] = torch.nn.functional.normalize(inputs["k"], dim=-1)  # keep the delta rule contractive
    o_default, _, _ = gated_delta_rule(**inputs, backend="naive")
    o_scaled, _, _ = gated_delta_rule(**inputs, scale=1.0, backend="torch", chunk_size=4)
    # The state does not depend on the query scale and the output is linear in q.
    assert max_diff(o_scaled * 4**-0.5, o_default) <= ATOL


def test_low_precision_inputs_return_their_dtype_and_fp32_states():
    inputs = delta_rule_inputs(1, 20, 2, 2, 8, 8, dtype=torch.bfloat16)
    o, final, captured = gated_delta_rule(**inputs, capture=(5,), chunk_size=8, use_qk_l2norm=True, backend="torch")
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32 and captured[5].dtype == torch.float32
    o_ref, final_ref, _ = gated_delta_rule(**inputs, use_qk_l2norm=True, backend="naive")
    assert max_diff(final, final_ref) <= ATOL  # computed in fp32 from the same bf16 inputs


def test_captured_states_are_independent_copies():
    inputs = delta_rule_inputs(1, 16, 1, 1, 4, 4)
    initial = random_state(1, 1, 4, 4)
    for backend in ("naive", "torch"):
        o, final, captured = gated_delta_rule(**inputs, initial_state=initial, capture=(0, 8, 16), chunk_size=8,
                                              backend=backend)  # fmt: skip
        before = initial.clone()
        for state in captured.values():
            state.add_(1.0)
        assert torch.equal(initial, before) and not torch.equal(captured[16], final), backend


def test_zero_length_call_returns_the_initial_state():
    inputs = delta_rule_inputs(1, 0, 2, 2, 4, 4)
    initial = random_state(1, 2, 4, 4)
    o, final, captured = gated_delta_rule(**inputs, initial_state=initial, capture=(0,))
    assert o.shape == (1, 0, 2, 4) and torch.equal(final, initial) and torch.equal(captured[0], initial)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("decay", [float("-inf"), -1e38])
def test_a_zero_decay_forgets_the_state_as_the_token_loop_does(per_channel, decay):
    """g = -inf (decay 0), or a g whose chunk's cumulative sum overflows to -inf: the chunked kernel subtracted
    cumulative sums, -inf - -inf = NaN, and returned NaN outputs, final and captured states."""
    inputs = delta_rule_inputs(1, 20, 2, 2, 8, 4, per_channel_decay=per_channel, seed=2)
    inputs["g"][0, 5:7, 0] = decay  # two tokens, so that -1e38 overflows a cumulative sum too
    common = {"initial_state": random_state(1, 2, 8, 4), "capture": (3, 6, 7, 11, 20), "chunk_size": 8,
              "use_qk_l2norm": True}  # fmt: skip
    o_ref, final_ref, states_ref = gated_delta_rule(**inputs, **common, backend="naive")
    o, final, states = gated_delta_rule(**inputs, **common, backend="torch")
    assert o_ref.isfinite().all() and final_ref.isfinite().all()
    assert max_diff(o, o_ref) <= ATOL and max_diff(final, final_ref) <= ATOL
    assert all(max_diff(states[p], states_ref[p]) <= ATOL for p in states_ref)


def test_compiled_backend_matches_torch_backend():
    inputs = delta_rule_inputs(1, 40, 2, 4, 8, 8, seed=11)
    initial = random_state(1, 4, 8, 8)
    runs = [gated_delta_rule(**inputs, initial_state=initial, capture=(0, 13, 32, 40), chunk_size=16,
                             use_qk_l2norm=True, backend=backend) for backend in ("torch", "compiled")]  # fmt: skip
    (o, final, states), (o_c, final_c, states_c) = runs
    assert max_diff(o, o_c) <= ATOL and max_diff(final, final_c) <= ATOL
    assert all(max_diff(states[p], states_c[p]) <= ATOL for p in states)


@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_gradients_flow_through_the_chunked_path(backend):
    inputs = delta_rule_inputs(1, 20, 1, 2, 4, 4, seed=6)
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    o, final, captured = gated_delta_rule(**leaves, capture=(9,), chunk_size=8, use_qk_l2norm=True, backend=backend)
    o_ref, final_ref, captured_ref = gated_delta_rule(**leaves, capture=(9,), use_qk_l2norm=True, backend="naive")
    grads = torch.autograd.grad((o.sum() + final.sum() + captured[9].sum()), list(leaves.values()))
    grads_ref = torch.autograd.grad((o_ref.sum() + final_ref.sum() + captured_ref[9].sum()), list(leaves.values()))
    assert all(max_diff(a, b) <= 1e-4 for a, b in zip(grads, grads_ref, strict=True))


# 0 heads: one row and one head a block; the torch backend only: the compiled one runs the same blocks (the
# loop is outside torch.compile), and each block shape would be one more graph to compile (about a minute here)
@pytest.mark.parametrize("budget_heads,batch,backend", [(1, 1, "torch"), (2, 2, "torch"), (0, 3, "torch")])
@pytest.mark.parametrize("per_channel", [False, True])
def test_cpu_blocks_of_rows_and_heads_give_the_whole_calls_results(monkeypatch, budget_heads, batch, backend,
                                                                   per_channel):
    """On the CPU rows and heads run in cache-sized blocks; outputs, final and captured states are the whole call's."""
    length, heads, dim = 40, 4, 8
    inputs = delta_rule_inputs(batch, length, 2, heads, dim, dim, per_channel_decay=per_channel, seed=3)
    initial = random_state(batch, heads, dim, dim, seed=4)
    common = {"initial_state": initial, "capture": (0, 13, 32, 40), "chunk_size": 16, "use_qk_l2norm": True,
              "backend": backend}
    whole = gated_delta_rule(**inputs, **common)
    per_head_bytes = length * max(dim, 16) * 4  # blocks are sized by the largest of K, V and the chunk
    monkeypatch.setattr(_chunks, "CPU_BLOCK_BYTES", max(budget_heads, 1) * batch ** (budget_heads > 0) * per_head_bytes)
    blocks = _chunks.cpu_blocks(torch.device("cpu"), batch, length, heads, 16)
    assert sum(len(row) for row in blocks) == (heads // max(budget_heads, 1)) * (batch if budget_heads == 0 else 1)
    blocked = gated_delta_rule(**inputs, **common)
    assert max_diff(blocked[0], whole[0]) <= ATOL and max_diff(blocked[1], whole[1]) <= ATOL
    assert sorted(blocked[2]) == sorted(whole[2])
    assert all(max_diff(blocked[2][p], whole[2][p]) <= ATOL for p in whole[2])


def test_cpu_blocks_divide_rows_and_heads_evenly_and_leave_other_devices_whole():
    cpu = torch.device("cpu")
    assert _chunks.cpu_blocks(cpu, 1, 4096, 16, 128) == [[(slice(0, 1), slice(h, h + 4)) for h in range(0, 16, 4)]]
    assert _chunks.cpu_blocks(cpu, 1, 4096, 12, 128) == [[(slice(0, 1), slice(h, h + 4)) for h in range(0, 12, 4)]]
    assert _chunks.cpu_blocks(cpu, 1, 100, 16, 128) == [[(slice(None), slice(None))]]
    assert _chunks.cpu_blocks(cpu, 3, 32768, 1, 128) == [[(slice(r, r + 1), slice(0, 1))] for r in range(3)]
    assert _chunks.cpu_blocks(torch.device("meta"), 8, 32768, 16, 128) == [[(slice(None), slice(None))]]
