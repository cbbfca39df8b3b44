"""compile_or_eager: a compiler that fails on a function (inductor has, on CUDA) costs speed, never a crash."""

import warnings

import pytest
import torch

from prefixlab.compile import compile_or_eager
from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import dispatch, gated_delta_rule
from prefixlab.recurrent.inputs import delta_rule_inputs


def failing_backend(calls: list):
    def backend(graph_module, example_inputs):
        calls.append(1)
        raise TypeError("list indices must be integers or slices, not NoneType")  # inductor's, seen on an H200
    return backend


def off_by_one_backend(calls: list):
    """A compiler that builds a wrong kernel: every output + 1 (or NaN)."""
    def backend(graph_module, example_inputs):
        calls.append(1)

        def run(*inputs):
            out = graph_module(*inputs)
            return type(out)(o + 1 for o in out) if isinstance(out, tuple | list) else out + 1
        return run
    return backend


def test_a_compile_failure_warns_once_and_runs_uncompiled():
    calls = []
    fn = compile_or_eager(lambda x: x * 2 + 1, "a test function", backend=failing_backend(calls))
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match="torch.compile failed on a test function .*TypeError"):
        assert torch.equal(fn(x), x * 2 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn(x + 1), (x + 1) * 2 + 1)  # no second warning, no second compile
    assert calls == [1] and fn.compile_failed


def test_prefixlab_errors_inside_compiled_code_pass_through():
    def backend(graph_module, example_inputs):
        raise InvalidInputError("the caller's mistake")

    fn = compile_or_eager(lambda x: x + 1, "a test function", backend=backend)
    with pytest.raises(InvalidInputError, match="the caller's mistake"):
        fn(torch.ones(2))
    assert not fn.compile_failed


def test_working_compiles_are_untouched():
    fn = compile_or_eager(lambda x: x * 3, "a test function", backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
    assert not fn.compile_failed


@pytest.mark.parametrize("backend, warning", [
    (failing_backend, "torch.compile failed on the recurrent kernel"),
    (off_by_one_backend, "torch.compile gave wrong results on the recurrent kernel"),
], ids=["compile-fails", "wrong-results"])
def test_the_compiled_recurrent_backend_falls_back_to_the_torch_one_bit_for_bit(monkeypatch, backend, warning):
    real_compile, calls = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=backend(calls)))
    dispatch.compiled.cache_clear()
    try:
        inputs = delta_rule_inputs(1, 40, 2, 2, 8, 8, seed=4)
        with pytest.warns(RuntimeWarning, match=warning):
            got = gated_delta_rule(**inputs, capture=(0, 17, 40), use_qk_l2norm=True, backend="compiled")
        want = gated_delta_rule(**inputs, capture=(0, 17, 40), use_qk_l2norm=True, backend="torch")
    finally:
        dispatch.compiled.cache_clear()  # the next test compiles for real
    assert calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][p], want[2][p]) for p in want[2])


def test_a_checked_device_catches_a_wrong_kernel_and_runs_that_shape_uncompiled():
    calls = []
    fn = compile_or_eager(lambda x: x * 2, "a test function", check_devices=("cpu",),
                          backend=off_by_one_backend(calls))
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match=r"gave wrong results on a test function \(max \|compiled - uncompiled\| 1"):
        assert torch.equal(fn(x), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn(x + 5), (x + 5) * 2)  # the same signature: uncompiled, not compiled or warned again
    assert calls == [1] and len(fn.wrong_results) == 1 and not fn.compile_failed
    with pytest.warns(RuntimeWarning, match="gave wrong results"):  # a new signature is compiled and checked
        assert torch.equal(fn(torch.ones(2, 3)), torch.full((2, 3), 2.0))
    unchecked = compile_or_eager(lambda x: x * 2, "a test function", backend=off_by_one_backend([]))
    assert torch.equal(unchecked(x), x * 2 + 1)  # checking is per device type, asked for


def test_a_checked_kernel_that_is_right_is_compared_once_per_compiled_graph(monkeypatch):
    import prefixlab.compile

    comparisons, real = [], prefixlab.compile._mismatch
    monkeypatch.setattr(prefixlab.compile, "_mismatch", lambda got, want: comparisons.append(1) or real(got, want))
    fn = compile_or_eager(torch.sin, "a test function", check_devices=("cpu",), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (torch.ones(5), torch.zeros(5), torch.ones(2, 2), torch.ones(5, dtype=torch.float64)):
            torch.testing.assert_close(fn(x), x.sin())
    assert not fn.wrong_results and len(comparisons) == 3  # a graph each: (5,) float32, (2, 2), (5,) float64


def test_the_uncompiled_reference_run_of_a_check_does_not_warn_about_running_uncompiled():
    """FlexAttention warns when it runs without torch.compile (it then materialises the scores); a checked device's
    reference run is uncompiled on purpose, so that warning (seen in `make bench`) would only worry a user."""
    def flex_like(x):
        if not torch.compiler.is_compiling():
            warnings.warn("flex_like called without torch.compile() - an unfused implementation", stacklevel=2)
        return x * 2

    fn = compile_or_eager(flex_like, "a test function", check_devices=("cpu",), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.warns(UserWarning, match="without torch.compile"):  # a caller's own uncompiled call still warns
        flex_like(torch.ones(3))


def test_nan_from_a_kernel_is_a_wrong_result():
    def nan_backend(graph_module, example_inputs):
        return lambda *inputs: tuple(o * float("nan") for o in graph_module(*inputs))

    fn = compile_or_eager(lambda x: x + 1, "a test function", check_devices=("cpu",), backend=nan_backend)
    with pytest.warns(RuntimeWarning, match="NaN where the uncompiled function has none"):
        assert torch.equal(fn(torch.zeros(3)), torch.ones(3))


AVX2_FLEX_CASE = """
import torch, warnings
from prefixlab.attention import SharedLevel, hydragen_attention
from prefixlab.attention import packed
g = torch.Generator().manual_seed(4)
rand = lambda *shape: torch.randn(*shape, generator=g)
q = rand(3, 4, 1, 8)
levels = [SharedLevel(rand(2, n, 8), rand(2, n, 8), p) for p, n in zip((None, 0, 0), (5, 3, 4))]
sk, sv = rand(3, 2, 4, 8), rand(3, 2, 4, 8)
ref = hydragen_attention(q, levels, sk, sv, seq_levels=[1, 2, 0], method="sdpa")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = hydragen_attention(q, levels, sk, sv, seq_levels=[1, 2, 0], method="packed")
print((out - ref).abs().max().item(), len(packed._compiled_flex("cpu").wrong_results))
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs an x86 CPU that runs AVX2 code")
def test_packed_hydragen_in_avx2_code_is_exact(tmp_path):
    """torch 2.13's CPU FlexAttention template, compiled to AVX2 code (what an AVX2-only CPU gets; forced here with
    ATEN_CPU_CAPABILITY, in a fresh inductor cache, since inductor's cache does not key on the ISA), returns wrong
    values at this small shape; the packed path must still match the reference."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AVX2_FLEX_CASE], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    error, caught = done.stdout.split()
    assert float(error) <= 1e-5, f"packed Hydragen off by {error} in AVX2 code ({caught} wrong compiled shapes caught)"




def test_a_compiled_kernel_that_crashes_runs_uncompiled_and_real_errors_still_raise():
    def crashing_backend(graph_module, example_inputs):
        def run(*inputs):
            raise RuntimeError("index out of bounds: 0 <= tmp36 < 6L")  # inductor's, on a stale cache
        return run

    fn = compile_or_eager(lambda x: x.reshape(2, -1).sum(0), "a test function", check_devices=("cpu",),
                          backend=crashing_backend)
    with pytest.warns(RuntimeWarning, match="gave wrong results on a test function .it raised RuntimeError: index"):
        assert torch.equal(fn(torch.ones(2, 3)), torch.full((3,), 2.0))
    assert len(fn.wrong_results) == 1
    with pytest.raises(RuntimeError, match="invalid for input of size 3"):  # the function's own error, not the crash
        fn(torch.ones(3))
    unchecked = compile_or_eager(lambda x: x.reshape(2, -1).sum(0), "a test function", backend=crashing_backend)
    with pytest.raises(RuntimeError, match="index out of bounds"):
        unchecked(torch.ones(2, 3))


@pytest.mark.parametrize("check_devices", [(), ("cpu",)], ids=["unchecked", "checked"])
def test_past_dynamos_recompile_limit_new_signatures_run_uncompiled(check_devices):
    """With fullgraph=True dynamo raises FailOnRecompileLimitHit past its recompile limit (8 graphs a function by
    default; the compiled recurrent backend's intra_chunk takes about 7 for one model's batch sizes and lengths):
    an unchecked device (CUDA) crashed, a checked one warned that the kernel gave wrong results."""
    double = eval(f"lambda x: x * 2  # {check_devices}")  # a code object of its own: dynamo counts per code object
    fn = compile_or_eager(double, "a test function", check_devices=check_devices, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            assert torch.equal(fn(torch.ones(2, 3)), torch.full((2, 3), 2.0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            assert torch.equal(fn(torch.ones(1, 2, 3)), torch.full((1, 2, 3), 2.0))
    assert not fn.wrong_results and not fn.compile_failed
