"""prefixlab's mamba_ssm backend: how it calls mamba_ssm (fakes with its published signatures and its varlen-state rule,
on any machine), and against the real kernels on a GPU (skipped without one / the package)."""

import functools

import pytest
import torch
from cuda_packages import install_fake_module, max_diff, needs_cuda, needs_package

from prefixlab.recurrent import cuda, ssd
from prefixlab.recurrent.inputs import random_state, ssd_inputs


def _fake_mamba_chunk_scan_combined(calls):
    """A stand-in for mamba_ssm 2.x's mamba_chunk_scan_combined with its published signature (raw dt: the kernel
    adds dt_bias, applies softplus and the limit, and D), computing with prefixlab's token loop. Its varlen states
    follow mamba_ssm's kernel (`_chunk_state_varlen_kernel`): the state at each sequence's end, where a chunk's start
    state is added only if the sequence began before that chunk (else the sequence starts from zeros)."""

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):  # fmt: skip
        assert z is None and seq_idx is None and return_final_states
        ends = cu_seqlens.tolist() if return_varlen_states else None
        calls.append((x.shape[1], ends))
        run = functools.partial(ssd, A=A, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                chunk_size=chunk_size, backend="naive")  # fmt: skip
        y, final, states = run(x, dt, B=B, C=C, initial_state=initial_states, capture=range(x.shape[1] + 1))
        if ends is None:
            return y, final
        varlen = []
        for start, end in zip(ends, ends[1:], strict=False):
            chunk_start = (end - 1) // chunk_size * chunk_size
            if start < chunk_start:
                varlen.append(states[end])
            else:  # mamba_ssm's kernel: the tokens from the later of start and the chunk start, from zeros
                begin = max(start, chunk_start)
                piece = slice(begin, end)
                varlen.append(run(x[:, piece], dt[:, piece], B=B[:, piece], C=C[:, piece])[1])
        return y, final, torch.cat(varlen)

    return mamba_chunk_scan_combined


@pytest.mark.parametrize("batch", [1, 2])
def test_mamba_ssm_backend_calls_mamba_ssm_as_published(monkeypatch, batch):
    """One sequence: one call, states from mamba_ssm's varlen states where its kernel gives them exactly (the ends
    of consecutive sequences, each begun before its end's chunk), the rest rolled forward by prefixlab's kernel from
    the nearest earlier state (here 5 in the first chunk, 21 after 20 in the same chunk). A batch: one call per
    segment between capture positions."""
    from prefixlab.recurrent.cuda import ssd_mamba_ssm

    calls = []
    install_fake_module(monkeypatch, "mamba_ssm.ops.triton.ssd_combined",
                        mamba_chunk_scan_combined=_fake_mamba_chunk_scan_combined(calls))
    monkeypatch.setattr(cuda, "_mamba_varlen_trusted", None)  # checked again, on this fake
    inputs = ssd_inputs(batch, 50, 4, 8, 2, 8, seed=6)
    initial = random_state(batch, 4, 8, 8)
    limit = (0.01, 0.05)  # Nemotron-H style: the kernel must get it
    positions = (0, 5, 20, 21, 40, 50)
    given = initial.clone()
    y, final, states = ssd_mamba_ssm(*inputs.values(), True, limit, given, positions, 16)
    # copies, as the torch backends give: the caller's state is a cache buffer a later step overwrites in place
    assert states[0] is not given and states[50] is not final and states[0].data_ptr() != given.data_ptr()
    y_ref, final_ref, states_ref = ssd(**inputs, dt_limit=limit, initial_state=initial, capture=positions,
                                       backend="naive")  # fmt: skip
    # one sequence: the varlen ends, and once per process one more at the last token (checked against the final state)
    assert calls == ([(50, [0, 20, 40, 50])] if batch == 1 else
                     [(5, None), (15, None), (1, None), (19, None), (10, None)])  # fmt: skip
    assert max_diff(y, y_ref) <= 1e-5 and max_diff(final, final_ref) <= 1e-5
    assert sorted(states) == list(positions)
    assert all(max_diff(states[p], states_ref[p]) <= 1e-5 for p in positions)
    if batch == 1:  # checked once: the next call asks for the served ends only
        ssd_mamba_ssm(*inputs.values(), True, limit, initial.clone(), positions, 16)
        assert calls[-1] == (50, [0, 20, 40]) and cuda._mamba_varlen_trusted is True


def test_mamba_ssm_varlen_states_that_miss_the_final_state_are_not_trusted(monkeypatch):
    """A mamba_ssm whose varlen states meant something else (here: each sequence from zeros, as with seq_idx) must not
    give wrong states: the first use's check finds it, warns, and states are captured by segments from then on."""
    calls = []
    scan = _fake_mamba_chunk_scan_combined(calls)

    def resetting(x, dt, A, B, C, chunk_size, **kwargs):  # every varlen state from zeros: a per-sequence reset
        out = scan(x, dt, A, B, C, chunk_size, **kwargs)
        if kwargs.get("return_varlen_states"):
            ends = kwargs["cu_seqlens"].tolist()
            pieces = [ssd(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], kwargs["D"], kwargs["dt_bias"], True,
                          backend="naive")[1] for s, e in zip(ends, ends[1:], strict=False)]  # fmt: skip
            out = (*out[:2], torch.cat(pieces))
        return out

    install_fake_module(monkeypatch, "mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=resetting)
    monkeypatch.setattr(cuda, "_mamba_varlen_trusted", None)
    inputs, initial = ssd_inputs(1, 50, 4, 8, 2, 8, seed=3), random_state(1, 4, 8, 8)
    with pytest.warns(UserWarning, match="captured by segments"):
        _, _, states = cuda.ssd_mamba_ssm(*inputs.values(), True, (0.0, float("inf")), initial.clone(), (20, 40), 16)
    _, _, states_ref = ssd(**inputs, initial_state=initial, capture=(20, 40), backend="naive")
    assert cuda._mamba_varlen_trusted is False and calls[0] == (50, [0, 20, 40, 50])
    assert all(max_diff(states[p], states_ref[p]) <= 1e-5 for p in (20, 40))


def test_mamba_ssm_backend_decodes_one_token_with_selective_state_update(monkeypatch):
    """A decode step (one token, no dt limit: mamba_ssm's step kernel takes none) goes to selective_state_update, one
    launch, per-head parameters expanded over the head dimension as its published signature takes them; with a dt
    limit it stays on the chunk scan (which applies it)."""
    from prefixlab.recurrent.cuda import ssd_mamba_ssm

    calls = []

    def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               state_batch_indices=None):  # fmt: skip
        heads, head_dim, state_size = state.shape[1:]
        assert x.shape == dt.shape == (state.shape[0], heads, head_dim) and A.shape == (heads, head_dim, state_size)
        assert D.shape == dt_bias.shape == (heads, head_dim) and z is None
        calls.append("step")
        y, final, _ = ssd(x[:, None], dt[:, None, :, 0], A[:, 0, 0], B[:, None], C[:, None], D, dt_bias[:, 0],
                          dt_softplus, initial_state=state, backend="naive")  # fmt: skip
        state.copy_(final)
        return y[:, 0]

    install_fake_module(monkeypatch, "mamba_ssm.ops.triton.ssd_combined",
                        mamba_chunk_scan_combined=_fake_mamba_chunk_scan_combined(calls))
    install_fake_module(monkeypatch, "mamba_ssm.ops.triton.selective_state_update",
                        selective_state_update=selective_state_update)
    inputs, initial = ssd_inputs(3, 1, 4, 8, 2, 8, seed=2), random_state(3, 4, 8, 8)
    for limit, expected in (((0.0, float("inf")), "step"), ((0.01, 0.05), (1, None))):
        y, final, states = ssd_mamba_ssm(*inputs.values(), True, limit, initial.clone(), (0, 1), 16)
        y_ref, final_ref, _ = ssd(**inputs, dt_limit=limit, initial_state=initial, backend="naive")
        assert calls.pop() == expected and not calls
        assert max_diff(y, y_ref) <= 1e-5 and max_diff(final, final_ref) <= 1e-5
        assert torch.equal(states[0], initial) and torch.equal(states[1], final)


def test_mamba_ssm_varlen_positions_are_those_its_kernel_serves_exactly():
    from prefixlab.recurrent.cuda import varlen_served

    assert varlen_served([5, 20, 21, 40], 16) == [20, 40]  # 5: first chunk; 21: after 20 in 20's chunk
    assert varlen_served([16, 17, 33, 48, 49], 16) == [17, 33, 49]  # 16 ends chunk 0; 48 ends 33's chunk
    assert varlen_served([], 16) == []


@needs_cuda
@needs_package("mamba_ssm")
@pytest.mark.parametrize("batch", [1, 2], ids=["one-pass", "segments"])
def test_mamba_ssm_backend_captures_prefix_states_and_resumes(batch):
    # bf16, as mamba_ssm is used (fp32 would run its dots in TF32); outputs reach ~4, a bf16 step of 1/32 there
    inputs = {n: t.cuda() for n, t in ssd_inputs(batch, 300, 8, 32, 2, 16, dtype=torch.bfloat16).items()}
    positions = (0, 30, 99, 120, 256, 300)  # first chunk, served, same chunk as the one before, chunk-aligned
    y, final, states = ssd(**inputs, capture=positions, chunk_size=64, backend="mamba_ssm")
    y_ref, final_ref, states_ref = ssd(**inputs, capture=positions, chunk_size=64, backend="torch")
    y_tolerance = 2e-2 * y_ref.abs().max().item()
    assert max_diff(y, y_ref) <= y_tolerance and max_diff(final, final_ref) <= 1e-2
    for p in positions:
        assert max_diff(states[p], states_ref[p]) <= 1e-2
        if p == 300:  # nothing left to resume
            continue
        tail = {name: t[:, p:] if name in ("x", "dt", "B", "C") else t for name, t in inputs.items()}
        y_tail, _, _ = ssd(**tail, initial_state=states[p], chunk_size=64, backend="mamba_ssm")
        assert max_diff(y_tail, y[:, p:]) <= y_tolerance


@needs_cuda
@needs_package("mamba_ssm")
def test_mamba_ssm_captures_leave_the_outputs_of_the_one_pass_bit_for_bit():
    inputs = {n: t.cuda() for n, t in ssd_inputs(1, 300, 8, 32, 2, 16, dtype=torch.bfloat16).items()}
    y, final, states = ssd(**inputs, capture=(30, 99, 120, 256), chunk_size=64, backend="mamba_ssm")
    y_plain, final_plain, _ = ssd(**inputs, chunk_size=64, backend="mamba_ssm")
    assert torch.equal(y, y_plain) and torch.equal(final, final_plain)
    assert sorted(states) == [30, 99, 120, 256]


@needs_cuda
@needs_package("mamba_ssm")
def test_mamba_ssm_backend_decodes_one_token_over_a_cached_state():
    inputs = {n: t.cuda() for n, t in ssd_inputs(2, 9, 8, 32, 2, 16, dtype=torch.bfloat16).items()}
    _, _, states = ssd(**inputs, capture=(8,), chunk_size=64, backend="torch")
    step = {name: t[:, 8:] if name in ("x", "dt", "B", "C") else t for name, t in inputs.items()}
    y, final, captured = ssd(**step, initial_state=states[8], capture=(0, 1), backend="mamba_ssm")
    y_ref, final_ref, _ = ssd(**step, initial_state=states[8], backend="naive")
    assert max_diff(y, y_ref) <= 2e-2 * y_ref.abs().max().item() and max_diff(final, final_ref) <= 1e-2
    assert torch.equal(captured[0], states[8]) and torch.equal(captured[1], final)
