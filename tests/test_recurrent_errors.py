"""Bad input to the kernels raises InvalidInputError naming the argument, and never touches the caller's tensors."""

import numpy as np
import pytest
import torch

from prefixlab.errors import InvalidInputError
from prefixlab.recurrent import gated_delta_rule, ssd
from prefixlab.recurrent.inputs import delta_rule_inputs, random_state, ssd_inputs

LENGTH = 6


def delta_call(**overrides) -> dict:
    call = {**delta_rule_inputs(1, LENGTH, 2, 4, 8, 4), "initial_state": random_state(1, 4, 8, 4)}
    return {**call, **overrides}


def ssd_call(**overrides) -> dict:
    call = {**ssd_inputs(1, LENGTH, 4, 8, 2, 16), "initial_state": random_state(1, 4, 8, 16)}
    return {**call, **overrides}


DELTA_CASES = [
    ({"capture": (LENGTH + 1,)}, "capture"),
    ({"capture": (-1,)}, "capture"),
    ({"capture": (3, 2)}, "capture"),
    ({"capture": (2, 2)}, "capture"),
    ({"capture": (1.5,)}, "capture"),
    ({"capture": torch.tensor([1])}, "capture"),
    ({"k": torch.zeros(1, LENGTH, 2, 7)}, "k"),
    ({"q": torch.zeros(1, LENGTH, 2, 8, dtype=torch.float64)}, "dtype"),
    ({"v": torch.zeros(1, LENGTH, 3, 4)}, "v has 3 heads"),
    # q / k without heads or without a key dim raised ZeroDivisionError (heads_v % 0, 0 ** -0.5)
    ({"q": torch.zeros(1, LENGTH, 0, 8), "k": torch.zeros(1, LENGTH, 0, 8)}, "q has 0 heads"),
    ({"q": torch.zeros(1, LENGTH, 2, 0), "k": torch.zeros(1, LENGTH, 2, 0),
      "initial_state": torch.zeros(1, 4, 0, 4)}, "key dim"),  # fmt: skip
    ({"g": torch.zeros(1, LENGTH, 2)}, "g"),
    ({"g": torch.zeros(1, LENGTH)}, "g"),
    ({"beta": torch.zeros(1, LENGTH + 1, 4)}, "beta"),
    ({"initial_state": torch.zeros(1, 4, 4, 8)}, "initial_state"),
    ({"initial_state": torch.zeros(1, 4, 8, 4, dtype=torch.float16)}, "initial_state"),
    ({"initial_state": torch.zeros(1, 4, 8, 4, device="meta")}, "initial_state"),
    ({"q": torch.zeros(1, LENGTH, 2, 8, dtype=torch.long)}, "q"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"),
    ({"chunk_size": np.float64(16)}, "chunk_size"),
    ({"backend": "triton"}, "backend"),
    ({"backend": "fla"}, "backend"),  # CPU tensors never go to a CUDA package, installed or not
    ({"scale": "big"}, "scale"),
    ({"scale": float("nan")}, "finite"),
    ({"scale": np.float32("inf")}, "finite"),
    ({"scale": True}, "scale"),
    ({"capture": (np.bool_(True),)}, "capture"),
    ({"use_qk_l2norm": "no"}, "use_qk_l2norm must be True or False"),  # (a truthy string normalised q and k)
    ({"use_qk_l2norm": None}, "use_qk_l2norm"),
]


@pytest.mark.parametrize("overrides,needle", DELTA_CASES)
def test_gated_delta_rule_rejects_bad_input(overrides, needle):
    call = delta_call(**overrides)
    before = {name: t.clone() for name, t in call.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    with pytest.raises(InvalidInputError, match=needle):
        gated_delta_rule(**call)
    assert all(torch.equal(call[name], t) for name, t in before.items())


SSD_CASES = [
    ({"capture": (0, LENGTH + 1)}, "capture"),
    ({"capture": [4, 1]}, "capture"),
    ({"dt": torch.zeros(1, LENGTH, 3)}, "dt"),
    ({"A": torch.zeros(3)}, "A"),
    ({"B": torch.zeros(1, LENGTH, 3, 16), "C": torch.zeros(1, LENGTH, 3, 16)}, "B has 3 groups"),
    ({"C": torch.zeros(1, LENGTH, 2, 15)}, "C"),
    ({"D": torch.zeros(4, 3)}, "D"),
    ({"D": 1.0}, "D must be a torch.Tensor"),  # (a raw AttributeError: 'float' object has no attribute 'dim')
    ({"D": [1.0] * 4}, "D must be a torch.Tensor"),
    ({"dt_bias": torch.zeros(5)}, "dt_bias"),
    ({"initial_state": torch.zeros(1, 4, 16, 8)}, "initial_state"),
    ({"x": torch.zeros(1, LENGTH, 4, 8, device="meta")}, "on meta"),
    ({"dt_limit": (1.0, 0.0)}, "dt_limit"),
    ({"dt_limit": None}, "dt_limit"),  # (a raw TypeError)
    ({"dt_limit": (0.0, None)}, "dt_limit"),
    ({"dt_limit": (0.0, float("nan"))}, "dt_limit"),
    ({"backend": "mamba_ssm"}, "backend"),
    ({"backend": "fla"}, "backend"),
    ({"dt_softplus": "False"}, "dt_softplus must be True or False"),  # (a truthy string applied the softplus)
]


@pytest.mark.parametrize("overrides,needle", SSD_CASES)
def test_ssd_rejects_bad_input(overrides, needle):
    call = ssd_call(**overrides)
    before = {name: t.clone() for name, t in call.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    with pytest.raises(InvalidInputError, match=needle):
        ssd(**call)
    assert all(torch.equal(call[name], t) for name, t in before.items())


def test_valid_calls_leave_inputs_unchanged():
    for fn, call in ((gated_delta_rule, delta_call(capture=(0, 3, LENGTH))), (ssd, ssd_call(capture=(0, 3, LENGTH)))):
        before = {name: t.clone() for name, t in call.items() if isinstance(t, torch.Tensor)}
        for backend in ("naive", "torch"):
            _, final, states = fn(**call, backend=backend)
            final.add_(1.0)
            states[0].add_(1.0)
        assert all(torch.equal(call[name], t) for name, t in before.items())


def test_capture_takes_numpy_integers_as_ints():
    """Positions computed with numpy (e.g. np.arange) are ints too; the states are keyed by Python ints."""
    for fn, call in ((gated_delta_rule, delta_call()), (ssd, ssd_call())):
        _, _, by_int = fn(**call, capture=(2, 5), backend="torch")
        _, _, by_numpy = fn(**call, capture=tuple(np.arange(2, 6, 3)), backend="torch")
        assert [type(p) for p in by_numpy] == [int, int]
        assert all(torch.equal(by_int[p], by_numpy[p]) for p in (2, 5))


def test_chunk_size_and_scale_take_numpy_scalars():
    """Sizes and scales computed with numpy give the bits Python numbers give (they were refused before)."""
    for fn, call, extra in ((gated_delta_rule, delta_call(), {"scale": 0.3}), (ssd, ssd_call(), {})):
        by_python = fn(**call, capture=(2, 5), backend="torch", chunk_size=4, **extra)
        numpy_extra = {name: np.float32(value) for name, value in extra.items()}
        by_numpy = fn(**call, capture=(2, 5), backend="torch", chunk_size=np.int64(4), **numpy_extra)
        if extra:  # np.float32(0.3) is not 0.3: compare against the same value as a Python float
            by_python = fn(**call, capture=(2, 5), backend="torch", chunk_size=4, scale=float(np.float32(0.3)))
        assert torch.equal(by_python[0], by_numpy[0]) and torch.equal(by_python[1], by_numpy[1])
        assert all(torch.equal(by_python[2][p], by_numpy[2][p]) for p in (2, 5))
