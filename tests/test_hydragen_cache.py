"""Shared-KV detection and the SharedPrefixLayer's bookkeeping, without a model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
