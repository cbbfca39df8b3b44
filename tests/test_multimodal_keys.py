"""Content keys of placeholder tokens (cache/multimodal.py `content_keys`, `MediaTokens.sliced`): the properties the
store's exactness rests on, over random batches of placeholders and features."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_outputs import BaseModelOutputWithPooling

from prefixlab.cache.multimodal import KEY_BASE, content_keys, first_key

IMAGE = 7


@st.composite
def batches(draw):
    """[batch, length] ids with runs of IMAGE placeholders, one feature row per placeholder, M-RoPE positions."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(2, 24))
    ids = torch.tensor(draw(st.lists(st.lists(st.sampled_from([1, 2, 3, IMAGE]), min_size=length, max_size=length),
                                     min_size=batch, max_size=batch)))
    count = int((ids == IMAGE).sum())
    seed = draw(st.integers(0, 2**16))
    features = torch.randn(count, 4, generator=torch.Generator().manual_seed(seed))
    text = torch.arange(length).expand(batch, length)
    shift = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=3, max_size=3)))[:, None, None]
    positions = text[None].expand(3, batch, length) + shift * (ids == IMAGE)[None]
    return ids, features, positions, text


def keys_of(ids, features, positions, text):
    output = BaseModelOutputWithPooling(pooler_output=[features])
    return content_keys(ids, IMAGE, output, positions, text)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_keys_replace_exactly_the_placeholders_and_lie_above_every_vocabulary(batch):
    ids, features, positions, text = batch
    keys = keys_of(ids, features, positions, text)
    placeholders = ids == IMAGE
    assert torch.equal(keys[~placeholders], ids[~placeholders])
    assert bool((keys[placeholders] >= KEY_BASE).all()) and bool((keys[placeholders] < KEY_BASE + 2**62).all())
    columns = placeholders.any(dim=0).nonzero()
    assert first_key(keys) == (int(columns.min()) if len(columns) else ids.shape[1])


@settings(max_examples=150, deadline=None)
@given(batches(), st.data())
def test_a_key_depends_on_its_own_feature_row_and_offset_only(batch, data):
    """Equal row and offset: equal key, wherever the token sits; another row or offset: another key. So two requests
    share a key exactly where the KV of that token (given the same keys before it) is the same."""
    ids, features, positions, text = batch
    if not len(features):
        return
    keys = keys_of(ids, features, positions, text)
    where = (ids == IMAGE).nonzero().tolist()
    k = data.draw(st.integers(0, len(features) - 1))
    changed = features.clone()
    changed[k, data.draw(st.integers(0, 3))] += 1.0
    other = keys_of(ids, changed, positions, text)
    row, column = where[k]
    assert other[row, column] != keys[row, column]
    unchanged = [i for i in range(len(features)) if i != k]
    assert all(other[where[i][0], where[i][1]] == keys[where[i][0], where[i][1]] for i in unchanged)
    moved = positions.clone()
    moved[1, row, column] += 1  # the token's M-RoPE height position: another place in the image
    assert keys_of(ids, features, moved, text)[row, column] != keys[row, column]


def test_features_that_do_not_fit_the_placeholders_key_nothing():
    ids = torch.tensor([[1, IMAGE, IMAGE, 2]])
    positions, text = torch.arange(4).expand(3, 1, 4), torch.arange(4)[None]
    assert keys_of(ids, torch.randn(3, 4), positions, text) is None
    assert content_keys(ids, IMAGE, None, positions, text) is None


@settings(max_examples=150, deadline=None)
@given(batches(), st.data())
def test_a_slice_of_columns_gets_the_feature_rows_of_its_own_placeholders(batch, data):
    """What the forward after a reused prefix (or a split segment) is handed: the rows of the placeholders in its
    columns, in the (row, column) order the model fills them, i.e. what the whole forward would have put there."""
    from prefixlab.cache.multimodal import MediaTokens

    ids, features, positions, _ = batch
    media = MediaTokens.__new__(MediaTokens)
    media.modality_ids = {"image": IMAGE}
    start = data.draw(st.integers(0, ids.shape[1] - 1))
    stop = data.draw(st.integers(start + 1, ids.shape[1]))
    kwargs = {"input_ids": ids, "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=[features])}}
    cut = media.sliced(kwargs, start, stop)["mm_encoder_outputs"]
    index = torch.full(ids.shape, -1)
    index[ids == IMAGE] = torch.arange(len(features))  # the whole forward's fill: (row, column) order
    expected = features[index[:, start:stop][ids[:, start:stop] == IMAGE]]
    if not len(expected):
        assert "image" not in cut or (start, stop) == (0, ids.shape[1])
        return
    got = cut["image"].pooler_output
    assert torch.equal(torch.cat(list(got)), expected)
