"""Backend dispatch (by device, never by what is importable), the segment driver of the CUDA backends, and the fla
backend (fakes on any machine; the real kernels skipped without a GPU / the package). mamba_ssm's backend:
test_recurrent_cuda_mamba_ssm.py."""

import sys
import types

import pytest
import torch
from cuda_packages import (
    FLA_SOLVE_PRECISION_MODULES,
    force_fla_ieee_solve,
    install_fake_module,
    max_diff,
    needs_cuda,
    needs_package,
)

from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import cuda, dispatch, gated_delta_rule
from prefixlab.recurrent.cuda import run_in_segments
from prefixlab.recurrent.delta_rule import fla_unsupported
from prefixlab.recurrent.inputs import delta_rule_inputs, random_state


def test_auto_never_picks_a_cuda_package_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(dispatch, "_installed", lambda package: True)
    assert dispatch.resolve_backend("auto", torch.device("cpu"), "fla") == "torch"
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "fla") == "fla"
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "fla", "takes bf16") == "torch"
    with pytest.raises(InvalidInputError, match="takes bf16"):
        dispatch.resolve_backend("fla", torch.device("cuda"), "fla", "takes bf16")
    with pytest.raises(InvalidInputError, match="needs CUDA tensors"):
        dispatch.resolve_backend("fla", torch.device("cpu"), "fla")


def test_auto_without_the_package_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(dispatch, "_installed", lambda package: False)
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "mamba_ssm") == "torch"
    with pytest.raises(InvalidInputError, match="pip install"):
        dispatch.resolve_backend("mamba_ssm", torch.device("cuda"), "mamba_ssm")


def test_auto_runs_one_token_as_a_recurrence_step_unless_a_cuda_package_takes_it(monkeypatch):
    # A decode step through the chunked kernel pads one token to a whole chunk: on a GPU that was ~47 extra kernel
    # launches per layer and step (fp32, or fla not installed), where the token loop is one step.
    monkeypatch.setattr(dispatch, "_installed", lambda package: False)
    for device in ("cpu", "cuda"):
        assert dispatch.resolve_backend("auto", torch.device(device), "fla", tokens=1) == "naive"
        assert dispatch.resolve_backend("auto", torch.device(device), "fla", tokens=2) == "torch"
    assert dispatch.resolve_backend("torch", torch.device("cpu"), "fla", tokens=1) == "torch"  # explicit: kept
    monkeypatch.setattr(dispatch, "_installed", lambda package: True)
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "fla", "takes bf16", tokens=1) == "naive"
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "fla", tokens=1) == "fla"


def test_segment_driver_captures_what_the_chunked_kernel_captures():
    # The CUDA backends split the sequence at the capture positions; check that driver with the CPU kernel.
    inputs = delta_rule_inputs(1, 45, 2, 2, 8, 8, seed=9)
    initial = random_state(1, 2, 8, 8)
    positions = (0, 7, 16, 33, 45)
    o, final, states = gated_delta_rule(**inputs, initial_state=initial, capture=positions, chunk_size=16,
                                        use_qk_l2norm=True, backend="torch")  # fmt: skip

    def segment(start, stop, state):
        piece = {name: t[:, start:stop] for name, t in inputs.items()}
        out, last, _ = gated_delta_rule(**piece, initial_state=state, chunk_size=16, use_qk_l2norm=True)
        return out, last

    o_seg, final_seg, states_seg = run_in_segments(45, positions, initial, segment)
    assert max_diff(o_seg, o) <= 1e-5 and max_diff(final_seg, final) <= 1e-5
    assert sorted(states_seg) == list(positions)
    assert all(max_diff(states_seg[p], states[p]) <= 1e-5 for p in positions)


def _fake_fla_kernel(name, calls):
    """A stand-in for fla 0.6.0's gated delta rule entry points, with fused_recurrent_gated_delta_rule's signature
    (positional order as published: g, gk, gv, beta; chunk_gated_delta_rule takes the same keywords), computing with
    prefixlab's token loop: checks how delta_rule_fla calls fla."""

    def kernel(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, **unused):
        assert gk is None and gv is None and beta is not None and output_final_state
        calls.append((name, q.shape[1]))
        out, final, _ = gated_delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
                                         scale=scale, backend="naive")
        return out, final
    return kernel


def test_fla_backend_calls_fla_as_published_chunked_for_segments_and_recurrent_for_one_token(monkeypatch):
    from prefixlab.recurrent.cuda import delta_rule_fla

    calls = []
    install_fake_module(monkeypatch, "fla.ops.gated_delta_rule",
                        chunk_gated_delta_rule=_fake_fla_kernel("chunk", calls),
                        fused_recurrent_gated_delta_rule=_fake_fla_kernel("recurrent", calls))
    # an fla without 0.6's chunk-state maker: the segment driver. (Without this, where fla is installed, the real
    # chunk module imported earlier in the session stayed in sys.modules and the tap found it.)
    chunk_module = "fla.ops.gated_delta_rule.chunk"
    monkeypatch.setitem(sys.modules, chunk_module, types.ModuleType(chunk_module))
    inputs = delta_rule_inputs(1, 20, 2, 2, 8, 8, seed=4)
    state = random_state(1, 2, 8, 8)
    o, final, states = delta_rule_fla(*inputs.values(), state.clone(), (0, 7, 8, 20), True, 8**-0.5)
    o_ref, final_ref, states_ref = gated_delta_rule(**inputs, initial_state=state, capture=(0, 7, 8, 20),
                                                    use_qk_l2norm=True, backend="naive")  # fmt: skip
    assert calls == [("chunk", 7), ("recurrent", 1), ("chunk", 12)]
    assert max_diff(o, o_ref) <= 1e-5 and max_diff(final, final_ref) <= 1e-5
    assert all(max_diff(states[p], states_ref[p]) <= 1e-5 for p in states_ref)


def _install_fake_fla_with_chunk_states(monkeypatch, calls, makes_chunk_states=True, h_layout="fla 0.6"):
    """fla 0.6.0's layout: the public chunk function reaches `chunk_gated_delta_rule_fwd_h` (the maker of the
    chunk-start states h [B, N, H, K, V]) as a global of fla.ops.gated_delta_rule.chunk. Computed with prefixlab's
    token loop, h in fp32 (fla keeps it in the inputs' dtype) so that the roll forward is checked to 1e-5."""
    install_fake_module(monkeypatch, "fla.ops.gated_delta_rule.chunk",
                        chunk_gated_delta_rule_fwd_h=lambda h, final: (h, None, final))
    chunk_module = sys.modules["fla.ops.gated_delta_rule.chunk"]

    def chunk(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False):
        calls.append(("chunk", q.shape[1]))
        starts = tuple(range(0, q.shape[1], 64))
        out, final, states = gated_delta_rule(q, k, v, g, beta, initial_state, capture=starts, scale=scale,
                                              use_qk_l2norm=use_qk_l2norm_in_kernel, backend="naive")
        if makes_chunk_states:  # looked up at call time, as fla's module-level call does
            h = torch.stack([states[s] for s in starts], dim=1)
            chunk_module.chunk_gated_delta_rule_fwd_h(h if h_layout == "fla 0.6" else h.transpose(-1, -2), final)
        return out, final

    monkeypatch.setattr(cuda, "_fla_h_trusted", None)  # checked again, on this fake
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", types.ModuleType("fla.ops.gated_delta_rule"))
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk
    sys.modules["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = _fake_fla_kernel("recurrent", calls)
    sys.modules["fla.ops.gated_delta_rule"].chunk = chunk_module


@pytest.mark.parametrize("makes_chunk_states", [True, False], ids=["one-pass", "other-fla-segments"])
def test_fla_backend_captures_from_the_chunk_pass_and_rolls_forward_inside_chunks(monkeypatch, makes_chunk_states):
    """States at any positions come out of the one chunk pass (its chunk-start states, then one fused recurrent
    call over every position's tokens inside its chunk, left-padded with inert tokens); the outputs are that pass's
    own. An fla that does not make chunk states the way 0.6 does gets the segment driver instead."""
    calls = []
    _install_fake_fla_with_chunk_states(monkeypatch, calls, makes_chunk_states)
    inputs = delta_rule_inputs(2, 200, 2, 2, 8, 8, seed=5)
    state = random_state(2, 2, 8, 8)
    positions = (0, 37, 64, 100, 128, 131, 200)
    o, final, states = cuda.delta_rule_fla(*inputs.values(), state.clone(), positions, True, 8**-0.5)
    o_ref, final_ref, states_ref = gated_delta_rule(**inputs, initial_state=state, capture=positions,
                                                    use_qk_l2norm=True, backend="naive")  # fmt: skip
    if makes_chunk_states:  # the first use's check (the last chunk's 8 tokens rolled onto fla's final state), then
        # one roll for 37, 100 and 131, as wide as the widest (37 tokens from chunk 0's start)
        assert calls == [("chunk", 200), ("recurrent", 8), ("recurrent", 37)]
    else:
        assert calls[0] == ("chunk", 200) and len(calls) == 1 + len(positions) - 1  # then one a segment
    assert sorted(states) == list(positions)
    assert max_diff(o, o_ref) <= 1e-5 and max_diff(final, final_ref) <= 1e-5
    assert all(max_diff(states[p], states_ref[p]) <= 1e-5 for p in positions)
    assert all(states[p].dtype == torch.float32 for p in positions)


def test_fla_chunk_states_that_do_not_roll_onto_the_final_state_are_not_trusted(monkeypatch):
    """A future fla whose h meant something else (here: the transposed layout, same shape when K == V) must not give
    wrong states: the first use's check finds it, warns, and states are captured by segments from then on."""
    calls = []
    _install_fake_fla_with_chunk_states(monkeypatch, calls, h_layout="transposed")
    inputs, state = delta_rule_inputs(1, 150, 2, 2, 8, 8, seed=8), random_state(1, 2, 8, 8)
    with pytest.warns(UserWarning, match="captured by segments"):
        o, final, states = cuda.delta_rule_fla(*inputs.values(), state.clone(), (40, 150), True, 8**-0.5)
    assert calls[:2] == [("chunk", 150), ("recurrent", 22)] and cuda._fla_h_trusted is False
    _, _, states_ref = gated_delta_rule(**inputs, initial_state=state, capture=(40, 150), use_qk_l2norm=True,
                                        backend="naive")  # fmt: skip
    assert all(max_diff(states[p], states_ref[p]) <= 1e-5 for p in (40, 150))


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_torch_backends_on_cuda_match_the_cpu_reference(backend):
    inputs = delta_rule_inputs(1, 70, 2, 4, 16, 16, seed=2)
    cpu = gated_delta_rule(**inputs, capture=(0, 31, 64, 70), use_qk_l2norm=True, backend="naive")
    gpu = gated_delta_rule(**{n: t.cuda() for n, t in inputs.items()}, capture=(0, 31, 64, 70), use_qk_l2norm=True,
                           backend=backend)  # fmt: skip
    assert max_diff(gpu[0], cpu[0]) <= 1e-4 and max_diff(gpu[1], cpu[1]) <= 1e-4
    assert all(max_diff(gpu[2][p], cpu[2][p]) <= 1e-4 for p in cpu[2])


@needs_cuda
@needs_package("fla")
def test_fla_backend_captures_prefix_states_and_resumes():
    inputs = {n: t.cuda() for n, t in delta_rule_inputs(2, 200, 2, 4, 64, 64, dtype=torch.bfloat16).items()}
    positions = (0, 37, 128, 150, 200)  # inside chunk 0, a chunk start, inside chunk 2, the end
    o, final, states = gated_delta_rule(**inputs, capture=positions, use_qk_l2norm=True, backend="fla")
    o_ref, final_ref, states_ref = gated_delta_rule(**inputs, capture=positions, use_qk_l2norm=True, backend="torch")
    assert max_diff(o, o_ref) <= 5e-2 and max_diff(final, final_ref) <= 5e-2  # fla computes in bf16 / tf32
    for p in positions:
        assert max_diff(states[p], states_ref[p]) <= 5e-2
        if p == 200:  # nothing left to resume (an empty tail has no outputs to compare)
            continue
        tail = {name: t[:, p:] for name, t in inputs.items()}
        o_tail, _, _ = gated_delta_rule(**tail, initial_state=states[p], use_qk_l2norm=True, backend="fla")
        assert max_diff(o_tail, o[:, p:]) <= 5e-2


@needs_cuda
@needs_package("fla")
def test_fla_captures_leave_the_outputs_of_the_one_pass_bit_for_bit():
    """Capturing inside fla's pass changes nothing it computes: the outputs and final state equal a call that
    captures nothing, bit for bit (the states come from the pass's own chunk states)."""
    inputs = {n: t.cuda() for n, t in delta_rule_inputs(2, 300, 2, 4, 64, 64, dtype=torch.bfloat16).items()}
    o, final, states = gated_delta_rule(**inputs, capture=(5, 64, 130, 299), use_qk_l2norm=True, backend="fla")
    o_plain, final_plain, _ = gated_delta_rule(**inputs, use_qk_l2norm=True, backend="fla")
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert sorted(states) == [5, 64, 130, 299]


@needs_cuda
@needs_package("fla")
def test_fla_backend_decodes_one_token_over_a_cached_state():
    inputs = {n: t.cuda() for n, t in delta_rule_inputs(2, 9, 2, 4, 64, 64, dtype=torch.bfloat16).items()}
    _, _, states = gated_delta_rule(**inputs, capture=(8,), use_qk_l2norm=True, backend="torch")
    step = {name: t[:, 8:] for name, t in inputs.items()}
    o, final, captured = gated_delta_rule(**step, initial_state=states[8], capture=(0, 1), use_qk_l2norm=True,
                                          backend="fla")  # fmt: skip
    o_ref, final_ref, _ = gated_delta_rule(**step, initial_state=states[8], use_qk_l2norm=True, backend="naive")
    assert max_diff(o, o_ref) <= 5e-2 and max_diff(final, final_ref) <= 5e-2
    assert max_diff(captured[0], states[8]) == 0 and max_diff(captured[1], final) == 0


def test_fp32_inputs_go_to_mamba_ssm_only_with_ieee_dots_and_never_to_fla(monkeypatch):
    """Triton computes fp32 dots in TF32 unless TRITON_F32_DEFAULT=ieee; fla 0.6 also hard-codes TF32 for its fused
    triangular solve on sm80+ GPUs (a module constant the setting does not reach), so fp32 never goes to fla."""
    monkeypatch.setattr(dispatch, "_installed", lambda package: True)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert dispatch.triton_dtype_unsupported(torch.bfloat16) is None
    assert fla_unsupported(torch.bfloat16, False) is None
    for reason in (dispatch.triton_dtype_unsupported(torch.float32), fla_unsupported(torch.float32, False)):
        assert dispatch.resolve_backend("auto", torch.device("cuda"), "mamba_ssm", reason) == "torch"
        with pytest.raises(InvalidInputError, match="TF32.*use backend='torch'"):
            dispatch.resolve_backend("mamba_ssm", torch.device("cuda"), "mamba_ssm", reason)
    for precision in ("tf32", "tf32x3"):
        monkeypatch.setenv("TRITON_F32_DEFAULT", precision)
        assert dispatch.triton_dtype_unsupported(torch.float32) is not None
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert dispatch.triton_dtype_unsupported(torch.float32) is None
    assert dispatch.resolve_backend("auto", torch.device("cuda"), "mamba_ssm", None) == "mamba_ssm"
    assert "triangular solve in TF32" in fla_unsupported(torch.float32, False)
    assert "float64" in dispatch.triton_dtype_unsupported(torch.float64)


def test_force_fla_ieee_solve_sets_tf32_solve_constants_to_ieee(monkeypatch):
    """fla as on an sm80+ GPU (its fused solve's precision constant at TF32, as fla 0.6 sets it there): the tests'
    override makes it IEEE in both kernels that have it and leaves an IEEE one alone."""
    import importlib.machinery

    class Constexpr(str):  # stands in for triton.language.constexpr: a value, rebuilt from its type
        @property
        def value(self):
            return str(self)

    install_fake_module(monkeypatch, "fla.ops.gated_delta_rule.chunk_fwd", SOLVE_TRIL_DOT_PRECISION=Constexpr("tf32"))
    install_fake_module(monkeypatch, "fla.ops.kda.chunk_intra", SOLVE_TRIL_DOT_PRECISION=Constexpr("ieee"))
    sys.modules["fla"].__spec__ = importlib.machinery.ModuleSpec("fla", None)  # find_spec reads it
    assert force_fla_ieee_solve() == ["fla.ops.gated_delta_rule.chunk_fwd"]
    for name in FLA_SOLVE_PRECISION_MODULES:
        precision = sys.modules[name].SOLVE_TRIL_DOT_PRECISION
        assert isinstance(precision, Constexpr) and precision.value == "ieee"
    assert force_fla_ieee_solve() == []
