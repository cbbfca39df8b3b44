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


def test_the_compiled_recurrent_backend_falls_back_to_the_torch_one_bit_for_bit(monkeypatch):
    real_compile, calls = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=failing_backend(calls)))
    dispatch.compiled.cache_clear()
    try:
        inputs = delta_rule_inputs(1, 40, 2, 2, 8, 8, seed=4)
        with pytest.warns(RuntimeWarning, match="torch.compile failed on the recurrent kernel"):
            got = gated_delta_rule(**inputs, capture=(0, 17, 40), use_qk_l2norm=True, backend="compiled")
        want = gated_delta_rule(**inputs, capture=(0, 17, 40), use_qk_l2norm=True, backend="torch")
    finally:
        dispatch.compiled.cache_clear()  # the next test compiles for real
    assert calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][p], want[2][p]) for p in want[2])
