"""Shared-KV detection and the SharedPrefixLayer's bookkeeping, without a model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from prefixlab.attention.dedupe import common_prefix_length, identical_row_groups
from prefixlab.attention.hf_cache import SharedBatchKV, SharedPrefixLayer
from prefixlab.errors import InvalidInputError


@settings(max_examples=30, deadline=None)
@given(common=st.integers(0, 6), rest=st.integers(0, 5), labels=st.lists(st.integers(0, 3), min_size=1, max_size=7),
       seed=st.integers(0, 1000))
def test_detection_finds_exactly_the_constructed_sharing(common, rest, labels, seed):
    """Rows = one common run + one of a few templates: the common length and the template groups come back."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(4, 2, rest, 3, generator=g)
    head = torch.randn(2, common, 3, generator=g)
    keys = torch.stack([torch.cat([head, templates[label]], dim=1) for label in labels])
    values = keys * 2
    found = common_prefix_length(keys, values)
    distinct = len(set(labels)) > 1 and rest > 0
    assert found == common if distinct else found == common + rest
    groups = identical_row_groups(keys, values)
    expected = {}  # with no template tokens every row is the same
    for row, label in enumerate(labels):
        expected.setdefault(label if rest else 0, []).append(row)
    assert sorted(rows.tolist() for rows in groups) == sorted(expected.values())


def test_detection_is_bitwise():
    keys = torch.zeros(2, 1, 4, 2)
    keys[1, 0, 2, 1] = 1e-30  # one bit of difference at token 2
    assert common_prefix_length(keys, keys.clone()) == 2
    assert len(identical_row_groups(keys, keys)) == 2


class RowVariantFloatMath(TorchFunctionMode):
    """What some BLAS builds do (the AMD CI failure): a product or reduction over a batch rounds each row by its place
    in the batch, here odd rows one ulp up. Code that decides sharing on bits is unaffected."""

    OPS = {torch.matmul, torch.mm, torch.mv, torch.bmm, torch.einsum, torch.sum, torch.mean, torch.dot,
           torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.mv, torch.Tensor.sum,
           torch.Tensor.mean}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.OPS and isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim():
            odd = (torch.arange(out.shape[0], device=out.device) % 2 == 1).view(-1, *[1] * (out.dim() - 1))
            out = torch.where(odd, torch.nextafter(out, torch.full_like(out, float("inf"))), out)
        return out


def test_detection_does_not_depend_on_row_invariant_float_math():
    """Bit-identical rows are grouped together even when every float product of the batch rounds per row."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    keys = rows[[0, 0, 1, 0, 1, 1]]
    with RowVariantFloatMath():
        groups = identical_row_groups(keys, keys * 2)
        found = common_prefix_length(keys[[0, 0, 3]], keys[[0, 0, 3]])
    assert [rows.tolist() for rows in groups] == [[0, 1, 3], [2, 4, 5]] and found == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_detection_compares_bits_not_float_values(dtype):
    """-0.0 and 0.0 compare equal as floats but are different KV bits; NaN never equals itself as a float, yet two
    copies of one NaN are the same bits, and NaNs with different payloads are not."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[dtype]
    quiet_nan = torch.tensor(float("nan"), dtype=dtype)
    other_nan = (quiet_nan.view(bits) + 1).view(dtype)  # another payload, still a NaN
    assert other_nan.isnan() and not torch.equal(quiet_nan.view(bits), other_nan.view(bits))
    keys = torch.ones(5, 1, 3, 2, dtype=dtype)
    keys[:, 0, 1, 0] = torch.stack([torch.tensor(0.0, dtype=dtype), torch.tensor(-0.0, dtype=dtype), quiet_nan,
                                    quiet_nan, other_nan])
    groups = identical_row_groups(keys, keys.clone())
    assert [rows.tolist() for rows in groups] == [[0], [1], [2, 3], [4]]
    assert common_prefix_length(keys[:2], keys[:2]) == 1  # 0.0 vs -0.0 at token 1
    assert common_prefix_length(keys[2:4], keys[2:4].clone()) == 3  # the same NaN bits: all shared
    assert common_prefix_length(keys[3:], keys[3:]) == 1


def _layer_with_tree():
    layer = SharedPrefixLayer()
    k = torch.randn(4, 2, 6, 8)
    k[2:] = k[:2]  # rows 2, 3 repeat rows 0, 1: no common prefix, groups {0, 2}, {1, 3}
    layer.update(k, k + 1, 0)
    return layer, k


def test_layer_stores_groups_once_and_hands_attention_a_shared_view():
    layer, k = _layer_with_tree()
    assert [lvl.length for lvl in layer.levels] == [6, 6] and layer.seq_levels.tolist() == [0, 1, 0, 1]
    assert layer.shared_bytes() == 2 * 2 * 2 * 6 * 8 * 4 and layer.per_sequence_bytes() == 0
    new = torch.randn(4, 2, 1, 8)
    view, same = layer.update(new, new, 0)
    assert isinstance(view, SharedBatchKV) and view is same and view.prefix_length == 6
    keys, values = view.materialize()
    assert torch.equal(keys, torch.cat([k, new], dim=2)) and torch.equal(values[:, :, :6], k + 1)
    assert layer.get_seq_length() == 7 and layer.get_mask_sizes(1) == (8, 0)


def test_layer_batch_edits_move_suffix_rows_only():
    layer, _ = _layer_with_tree()
    new = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 2, 1, 8)
    layer.update(new, new, 0)
    layer.reorder_cache(torch.tensor([3, 3, 0, 1]))
    assert layer.seq_levels.tolist() == [1, 1, 0, 1] and layer.keys[:, 0, 0, 0].tolist() == [3, 3, 0, 1]
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape[0] == 8 and len(layer.levels) == 2
    layer.crop(-1)
    assert layer.get_seq_length() == 6
    with pytest.raises(InvalidInputError, match="shared prefix"):
        layer.crop(-1)
    layer.reset()
    assert not layer.is_initialized and not layer.levels and layer.get_seq_length() == 0


def test_layer_refuses_a_different_batch():
    layer, _ = _layer_with_tree()
    with pytest.raises(InvalidInputError, match="holds 4 sequences"):
        layer.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8), 0)
