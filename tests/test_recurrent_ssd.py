"""ssd (Mamba2): exact states at any position, resume == full run, and agreement with transformers' torch path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.recurrent import _chunks, ssd
from prefixlab.recurrent.hf_reference import hf_mamba2_chunk_scan
from prefixlab.recurrent.inputs import random_state, ssd_inputs

ATOL = 1e-5
PER_TOKEN = ("x", "dt", "B", "C")
PER_HEAD = ("A", "D", "dt_bias")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def tokens(inputs: dict, start: int, stop: int) -> dict:
    return {name: inputs[name][:, start:stop] if name in PER_TOKEN else inputs[name] for name in inputs}


@st.composite
def ssd_cases(draw):
    chunk_size = draw(st.sampled_from([4, 8, 16]))
    length = draw(st.integers(1, 3 * chunk_size + 3))
    return {
        "chunk_size": chunk_size,
        "length": length,
        "heads_groups": draw(st.sampled_from([(2, 1), (4, 2), (3, 3)])),
        "positions": tuple(sorted(draw(st.sets(st.integers(0, length), max_size=4)))),
        "with_state": draw(st.booleans()),
        "backend": draw(st.sampled_from(["torch", "naive"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None)
@given(ssd_cases())
def test_captured_states_are_prefix_final_states_and_resume_exactly(case):
    heads, groups = case["heads_groups"]
    inputs = ssd_inputs(2, case["length"], heads, 4, groups, 6, seed=case["seed"])
    initial = random_state(2, heads, 4, 6, seed=case["seed"]) if case["with_state"] else None
    common = {"chunk_size": case["chunk_size"], "backend": case["backend"]}
    y, final, captured = ssd(**inputs, initial_state=initial, capture=case["positions"], **common)

    assert sorted(captured) == list(case["positions"])
    for p, state in captured.items():
        assert state.dtype == torch.float32 and state.shape == final.shape
        _, prefix_final, _ = ssd(**tokens(inputs, 0, p), initial_state=initial, **common)
        assert max_diff(state, prefix_final) <= ATOL, f"state at {p}"
        y_tail, final_tail, _ = ssd(**tokens(inputs, p, case["length"]), initial_state=state, **common)
        assert max_diff(y_tail, y[:, p:]) <= ATOL, f"resume from {p}"
        assert max_diff(final_tail, final) <= ATOL, f"final after resuming from {p}"


@settings(max_examples=15, deadline=None)
@given(ssd_cases())
def test_chunked_matches_token_by_token_reference(case):
    heads, groups = case["heads_groups"]
    inputs = ssd_inputs(1, case["length"], heads, 4, groups, 6, seed=case["seed"])
    initial = random_state(1, heads, 4, 6, seed=case["seed"]) if case["with_state"] else None
    (y_ref, final_ref, states_ref), (y, final, states) = (
        ssd(**inputs, initial_state=initial, capture=case["positions"], chunk_size=case["chunk_size"], backend=b)
        for b in ("naive", "torch")
    )
    assert max_diff(y, y_ref) <= ATOL and max_diff(final, final_ref) <= ATOL
    assert all(max_diff(states[p], states_ref[p]) <= ATOL for p in case["positions"])


@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("length,chunk_size", [(50, 16), (32, 32), (5, 256)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers_mamba2_torch_path(heads, groups, length, chunk_size, with_state):
    inputs = ssd_inputs(2, length, heads, 8, groups, 16, seed=length)
    initial = random_state(2, heads, 8, 16) if with_state else None
    limit = (0.0, 0.05)  # exercise the clamp too
    y_ref, final_ref = hf_mamba2_chunk_scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                                            chunk_size=chunk_size, D=inputs["D"], dt_bias=inputs["dt_bias"],
                                            initial_states=initial, dt_softplus=True, dt_limit=limit,
                                            return_final_states=True)  # fmt: skip
    for backend in ("torch", "naive"):
        y, final, _ = ssd(**inputs, initial_state=initial, dt_limit=limit, chunk_size=chunk_size, backend=backend)
        assert max_diff(y, y_ref) <= ATOL and max_diff(final, final_ref) <= ATOL, backend


def test_dt_options_follow_the_recurrence():
    inputs = ssd_inputs(1, 12, 2, 4, 1, 4, seed=2)
    raw = {**inputs, "dt": torch.nn.functional.softplus(inputs["dt"] + inputs["dt_bias"]), "dt_bias": None}
    y, final, _ = ssd(**inputs, chunk_size=4, backend="torch")
    y_raw, final_raw, _ = ssd(**raw, dt_softplus=False, chunk_size=4, backend="naive")
    assert max_diff(y, y_raw) <= ATOL and max_diff(final, final_raw) <= ATOL
    y_no_d, _, _ = ssd(**{**inputs, "D": None}, chunk_size=4, backend="torch")
    assert max_diff(y - y_no_d, inputs["x"] * inputs["D"][:, None]) <= ATOL
    _, final_frozen, _ = ssd(**inputs, dt_limit=(0.0, 0.0), chunk_size=4, backend="torch")
    assert torch.count_nonzero(final_frozen) == 0  # dt clamped to 0: nothing is ever written


def test_per_channel_skip_d_broadcasts_over_head_dim():
    inputs = ssd_inputs(1, 6, 2, 3, 1, 4)
    per_head_dim = inputs["D"][:, None].expand(2, 3).contiguous()
    y, _, _ = ssd(**inputs, backend="torch")
    y_hp, _, _ = ssd(**{**inputs, "D": per_head_dim}, backend="torch")
    assert max_diff(y, y_hp) == 0.0


def test_low_precision_inputs_return_their_dtype_and_fp32_states():
    inputs = ssd_inputs(1, 20, 2, 4, 1, 8, dtype=torch.bfloat16)
    y, final, captured = ssd(**inputs, capture=(7,), chunk_size=8, backend="torch")
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32 and captured[7].dtype == torch.float32
    _, final_ref, _ = ssd(**inputs, backend="naive")
    assert max_diff(final, final_ref) <= ATOL


def test_a_zero_decay_forgets_the_state_as_the_token_loop_does():
    """A = -inf (a head whose state decays to 0 each token): the chunked kernel subtracted cumulative sums,
    -inf - -inf = NaN, and returned NaN outputs and states."""
    inputs = ssd_inputs(1, 20, 2, 4, 1, 8, seed=3)
    inputs["A"][0] = float("-inf")
    common = {"initial_state": random_state(1, 2, 4, 8), "capture": (3, 8, 11, 20), "chunk_size": 8}
    y_ref, final_ref, states_ref = ssd(**inputs, **common, backend="naive")
    y, final, states = ssd(**inputs, **common, backend="torch")
    assert y_ref.isfinite().all() and final_ref.isfinite().all()
    assert max_diff(y, y_ref) <= ATOL and max_diff(final, final_ref) <= ATOL
    assert all(max_diff(states[p], states_ref[p]) <= ATOL for p in states_ref)


def test_compiled_backend_matches_torch_backend():
    inputs = ssd_inputs(1, 40, 4, 8, 2, 8, seed=4)
    initial = random_state(1, 4, 8, 8)
    (y, final, states), (y_c, final_c, states_c) = (
        ssd(**inputs, initial_state=initial, capture=(0, 9, 32, 40), chunk_size=16, backend=backend)
        for backend in ("torch", "compiled")
    )
    assert max_diff(y, y_c) <= ATOL and max_diff(final, final_c) <= ATOL
    assert all(max_diff(states[p], states_c[p]) <= ATOL for p in states)



def test_gradients_flow_through_the_chunked_path():
    inputs = ssd_inputs(1, 20, 2, 4, 1, 4, seed=6)
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    runs = [ssd(**leaves, capture=(9,), chunk_size=8, backend=backend) for backend in ("torch", "naive")]
    grads = [torch.autograd.grad(y.sum() + final.sum() + states[9].sum(), list(leaves.values()))
             for y, final, states in runs]  # fmt: skip
    assert all(max_diff(a, b) <= 1e-4 for a, b in zip(*grads, strict=True))


# 0 heads: one row and one head a block; the torch backend only: the compiled one runs the same blocks (the
# loop is outside torch.compile), and each block shape would be one more graph to compile (about a minute here)
@pytest.mark.parametrize("heads_per_block,batch,backend", [(1, 1, "torch"), (2, 2, "torch"), (0, 3, "torch")])
def test_cpu_blocks_of_rows_and_heads_give_the_whole_calls_results(monkeypatch, heads_per_block, batch, backend):
    """On the CPU rows and heads run in cache-sized blocks (each head its own A); results are the whole call's."""
    length, heads, chunk_size = 40, 4, 16
    inputs = ssd_inputs(batch, length, heads, 8, 2, 8, seed=5)
    common = {"initial_state": random_state(batch, heads, 8, 8, seed=6), "capture": (0, 13, 32, 40),
              "chunk_size": chunk_size, "backend": backend}
    whole = ssd(**inputs, **common)
    per_head_bytes = length * chunk_size * 4  # blocks are sized by the largest of P, N and the chunk
    monkeypatch.setattr(_chunks, "CPU_BLOCK_BYTES",
                        max(heads_per_block, 1) * batch ** (heads_per_block > 0) * per_head_bytes)
    blocks = _chunks.cpu_blocks(torch.device("cpu"), batch, length, heads, chunk_size)
    assert sum(map(len, blocks)) == (heads // max(heads_per_block, 1)) * (batch if heads_per_block == 0 else 1)
    blocked = ssd(**inputs, **common)
    assert max_diff(blocked[0], whole[0]) <= ATOL and max_diff(blocked[1], whole[1]) <= ATOL
    assert sorted(blocked[2]) == sorted(whole[2])
    assert all(max_diff(blocked[2][p], whole[2][p]) <= ATOL for p in whole[2])
