"""hydragen_attention: split and packed-tree paths against the dense SDPA reference, and its input checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.attention import SharedLevel, choose_method, hydragen_attention
from prefixlab.attention.packed import packed_tree_attention, varlen_prefill_attention
from prefixlab.attention.reference import reference_attention
from prefixlab.attention.split import split_attention
from prefixlab.attention.tree import plan_tree
from prefixlab.errors import InvalidInputError

ATOL = 1e-5


def _rand(g, *shape):
    return torch.randn(*shape, generator=g)


def _case(seed, batch=3, kv_heads=2, group=2, queries=2, slots=4, dim=8, parents=(None, 0, 0), lengths=(5, 3, 4)):
    g = torch.Generator().manual_seed(seed)
    q = _rand(g, batch, kv_heads * group, queries, dim)
    levels = [
        SharedLevel(_rand(g, kv_heads, n, dim), _rand(g, kv_heads, n, dim), p)
        for p, n in zip(parents, lengths, strict=True)
    ]
    return q, levels, _rand(g, batch, kv_heads, slots, dim), _rand(g, batch, kv_heads, slots, dim)


@st.composite
def batches(draw):
    """A random forest of levels, each sequence under a random level (or none), random GQA/query/suffix shapes."""
    n_levels = draw(st.integers(0, 4))
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n_levels)]
    lengths = [draw(st.integers(0, 9)) for _ in range(n_levels)]
    batch, queries = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    slots = draw(st.integers(queries, queries + 4))
    q, levels, sk, sv = _case(draw(st.integers(0, 2**16)), batch, draw(st.integers(1, 2)), draw(st.integers(1, 3)),
                              queries, slots, 8, parents[:n_levels], lengths)
    seq_levels = [draw(st.integers(-1, n_levels - 1)) for _ in range(batch)]
    suffix_lengths = [draw(st.integers(queries, slots)) for _ in range(batch)] if draw(st.booleans()) else None
    return q, levels, sk, sv, seq_levels, suffix_lengths


@settings(max_examples=20, deadline=None)
@given(batches())
def test_split_and_packed_equal_reference(case):
    q, levels, sk, sv, seq_levels, suffix_lengths = case
    plan = plan_tree(q, levels, sk, sv, seq_levels, suffix_lengths=suffix_lengths)
    ref = reference_attention(q, plan, sk, sv, 0.3)
    torch.testing.assert_close(split_attention(q, plan, sk, sv, 0.3), ref, atol=ATOL, rtol=0)
    # eager FlexAttention: same mask_mod and packing as the compiled path, without a compile per shape
    torch.testing.assert_close(packed_tree_attention(q, plan, sk, sv, 0.3, compiled=False), ref, atol=ATOL, rtol=0)


def test_reference_is_plain_sdpa_over_materialised_rows():
    q, levels, sk, sv = _case(3, parents=(None, 0), lengths=(5, 3))
    out = hydragen_attention(q, levels, sk, sv, seq_levels=[1, 0, -1], method="sdpa")
    rows = [torch.cat([levels[0].keys, levels[1].keys, sk[0]], 1), torch.cat([levels[0].keys, sk[1]], 1), sk[2]]
    values = [torch.cat([levels[0].values, levels[1].values, sv[0]], 1), torch.cat([levels[0].values, sv[1]], 1), sv[2]]
    for b in range(3):
        length = rows[b].shape[1]
        causal = torch.ones(2, length, dtype=torch.bool).tril(length - 2)
        ref = F.scaled_dot_product_attention(q[b : b + 1], rows[b][None], values[b][None], attn_mask=causal,
                                             enable_gqa=True)
        torch.testing.assert_close(out[b : b + 1], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("queries,slots", [(1, 6), (6, 6)], ids=["decode", "prefill"])
def test_public_api_methods_agree(queries, slots):
    q, levels, sk, sv = _case(1, batch=4, queries=queries, slots=slots)
    seq_levels = [1, 2, 2, 0]
    ref = hydragen_attention(q, levels, sk, sv, seq_levels=seq_levels, method="sdpa")
    # compiled FlexAttention for the packed path costs a compile per shape on CPU: once is enough here
    for method in ("split", "auto") + (("packed",) if queries == 1 else ()):
        out = hydragen_attention(q, levels, sk, sv, seq_levels=seq_levels, method=method)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_compiled_packed_path_on_cpu_over_changing_query_and_key_lengths():
    """torch's CPU flex template fails to build once both lengths are dynamic (the second shape change of a
    process): the CPU path compiles static shapes, so each new shape compiles (or runs eager past dynamo's limit)."""
    for queries, lengths in [(1, (5, 3, 4)), (3, (5, 3, 4)), (1, (6, 3, 4)), (2, (7, 2, 4))]:
        q, levels, sk, sv = _case(4, queries=queries, slots=4, lengths=lengths)
        ref = hydragen_attention(q, levels, sk, sv, seq_levels=[1, 2, 0], method="sdpa")
        out = hydragen_attention(q, levels, sk, sv, seq_levels=[1, 2, 0], method="packed")
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    with pytest.raises(InvalidInputError, match="method='split'"):
        hydragen_attention(q.double(), [SharedLevel(lv.keys.double(), lv.values.double(), lv.parent) for lv in levels],
                           sk.double(), sv.double(), method="packed")


def test_varlen_prefill_without_padding():
    """Prompts of 3, 5 and 2 tokens packed back to back, two of them after a shared level: causal per prompt."""
    g = torch.Generator().manual_seed(7)
    lengths, kv_heads, q_heads, dim = [3, 5, 2], 2, 4, 8
    level = SharedLevel(_rand(g, kv_heads, 6, dim), _rand(g, kv_heads, 6, dim))
    q, k, v = _rand(g, 10, q_heads, dim), _rand(g, 10, kv_heads, dim), _rand(g, 10, kv_heads, dim)
    out = varlen_prefill_attention(q, k, v, lengths, [level], seq_levels=[0, -1, 0], compiled=False)
    start = 0
    for n, shared in zip(lengths, [True, False, True], strict=True):
        keys, values = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
        if shared:
            keys, values = torch.cat([level.keys, keys], 1), torch.cat([level.values, values], 1)
        mask = torch.ones(n, keys.shape[1], dtype=torch.bool).tril(keys.shape[1] - n)
        ref = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], ref, atol=ATOL, rtol=0)
        start += n
    with pytest.raises(InvalidInputError, match="sum to the packed token count"):
        varlen_prefill_attention(q, k, v, [3, 5, 3])
    # were errors deep in torch: repeat_interleave on floats / bools, a head_dim mismatch, mixed dtypes computed
    for bad in ([3.0, 5.0, 2.0], [True] * 10):
        with pytest.raises(InvalidInputError, match="lengths="):
            varlen_prefill_attention(q, k, v, bad, compiled=False)
    with pytest.raises(InvalidInputError, match="head_dim"):
        varlen_prefill_attention(q, k[..., :4], v[..., :4], lengths, compiled=False)
    with pytest.raises(InvalidInputError, match="dtype"):
        varlen_prefill_attention(q.double(), k, v, lengths, compiled=False)


def test_empty_prefix_is_plain_attention_bit_for_bit():
    q, _, sk, sv = _case(2, queries=1)
    empty = SharedLevel(sk[0, :, :0], sv[0, :, :0])
    out = hydragen_attention(q, [empty], sk, sv)
    assert torch.equal(out, F.scaled_dot_product_attention(q, sk, sv, enable_gqa=True))
    assert choose_method(q, plan_tree(q, [empty], sk, sv)) == "sdpa"


def test_auto_splits_on_cpu_when_something_is_shared():
    q, levels, sk, sv = _case(4)
    assert choose_method(q, plan_tree(q, levels, sk, sv)) == "split"


def test_one_level_decode_batch_matches_per_sequence_sdpa():
    """The benchmark's shape family: one prefix, GQA 8:1, decode."""
    g = torch.Generator().manual_seed(5)
    q, pk, pv = _rand(g, 16, 8, 1, 32), _rand(g, 1, 64, 32), _rand(g, 1, 64, 32)
    sk, sv = _rand(g, 16, 1, 9, 32), _rand(g, 16, 1, 9, 32)
    out = hydragen_attention(q, [SharedLevel(pk, pv)], sk, sv, method="split")
    full_k = torch.cat([pk.expand(16, 1, 64, 32), sk], 2)
    full_v = torch.cat([pv.expand(16, 1, 64, 32), sv], 2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, full_k, full_v, enable_gqa=True), atol=ATOL,
                               rtol=0)


def _bad(**overrides):
    q, levels, sk, sv = _case(0)
    args = dict(q=q, levels=levels, suffix_keys=sk, suffix_values=sv, seq_levels=None)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(q=torch.randn(3, 3, 2, 8)), "multiple of the KV heads"),
        (dict(suffix_keys=torch.randn(2, 2, 4, 8), suffix_values=torch.randn(2, 2, 4, 8)), "one suffix per sequence"),
        (dict(seq_levels=[0, 1]), "one per sequence"),
        (dict(suffix_lengths=[4, 4]), "suffix_lengths has 2 entries"),
        (dict(suffix_lengths=[4, 1, 4]), r"must lie in \[queries"),
        (dict(q=torch.randn(3, 4, 5, 8)), "append the new tokens"),
        (dict(levels=[SharedLevel(torch.randn(2, 3, 8), torch.randn(2, 3, 8), 1),
                      SharedLevel(torch.randn(2, 3, 8), torch.randn(2, 3, 8), 0)]), "cycle"),
        (dict(levels=[SharedLevel(torch.randn(2, 3, 8), torch.randn(2, 3, 8), 5)]), "parent=5"),
        (dict(levels=[SharedLevel(torch.randn(1, 3, 8), torch.randn(1, 3, 8))]), "kv_heads=2"),
        (dict(levels=[SharedLevel(torch.randn(2, 3, 8).double(), torch.randn(2, 3, 8).double())]), "dtype"),
        (dict(levels=[SharedLevel(torch.randn(2, 3, 8, device="meta"), torch.randn(2, 3, 8))]), "device"),
        (dict(suffix_mask=torch.ones(3, 2, 3, dtype=torch.bool)), "suffix_mask has shape"),
        (dict(method="fast"), "method='fast'"),
        (dict(suffix_lengths=[2.5, 3, 4]), "must be integers"),
        (dict(suffix_lengths=[3, "4", 4]), "must be integers"),  # (was torch's TypeError from as_tensor)
        (dict(suffix_lengths="344"), "must be integers"),
        (dict(scale=float("nan")), "finite number"),
        (dict(scale="0.3"), "finite number"),
        (dict(scale=True), "finite number"),
    ],
)
def test_bad_input_raises_clear_error(overrides, match):
    args = _bad(**overrides)
    with pytest.raises(InvalidInputError, match=match):
        hydragen_attention(args.pop("q"), args.pop("levels"), args.pop("suffix_keys"), args.pop("suffix_values"),
                           **args)


def test_scale_takes_numpy_scalars_as_floats():
    """A scale computed with numpy (np.float32(d) ** -0.5) gives the bits a Python float of the same value gives."""
    for method in ("split", "sdpa"):
        args = _bad()
        by_float = hydragen_attention(args.pop("q"), args.pop("levels"), args.pop("suffix_keys"),
                                      args.pop("suffix_values"), scale=0.25, method=method, **args)
        args = _bad()
        by_numpy = hydragen_attention(args.pop("q"), args.pop("levels"), args.pop("suffix_keys"),
                                      args.pop("suffix_values"), scale=np.float32(0.25), method=method, **args)
        assert torch.equal(by_float, by_numpy)


@pytest.mark.parametrize("method", ["split", "auto", "sdpa", "packed"])
@pytest.mark.parametrize("suffix", ["causal", "lengths", "mask", "none"])
def test_zero_queries_give_an_empty_output(method, suffix):
    """ATen's fused CPU kernel, handed zero queries, killed the process (SIGFPE); with suffix lengths or a mask, no
    suffix slot, or the packed method, zero queries raised a reshape / index error."""
    from prefixlab.attention import attention_with_lse

    q, levels, sk, sv = _case(1, queries=0, slots=0 if suffix == "none" else 4)
    options = {"lengths": {"suffix_lengths": [4, 2, 3]}, "mask": {"suffix_mask": torch.ones(3, 0, 4, dtype=bool)}}
    assert hydragen_attention(q, levels, sk, sv, method=method, **options.get(suffix, {})).shape == (3, 4, 0, 8)
    out, lse = attention_with_lse(torch.randn(1, 2, 0, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0) and lse.dtype == torch.float32


@pytest.mark.parametrize("seq_levels", [[0.7, 1.9, 0], torch.tensor([0.5, 1.5, 0.0]), [True, False, 0],
                                        ["0", "0", "0"]])
def test_seq_levels_must_be_int_indices(seq_levels):
    """0.7 was read as level 0 and True as level 1."""
    args = _bad(seq_levels=seq_levels)
    with pytest.raises(InvalidInputError, match="seq_levels must hold int level indices"):
        hydragen_attention(args.pop("q"), args.pop("levels"), args.pop("suffix_keys"), args.pop("suffix_values"),
                           **args)
    q, levels, sk, sv = _case(2)
    levels[2] = SharedLevel(levels[2].keys, levels[2].values, True)  # (parent 1, silently)
    with pytest.raises(InvalidInputError, match="parent=True"):
        hydragen_attention(q, levels, sk, sv)


@pytest.mark.parametrize("shapes, match", [
    (((1, 4, 2, 8), (1, 3, 6, 8), (1, 3, 6, 8)), "multiple of Hkv"),  # read past k (wrong numbers)
    (((2, 4, 2, 8), (1, 2, 6, 8), (1, 2, 6, 8)), "same N"),
    (((1, 4, 2, 8), (1, 2, 5, 8), (1, 2, 4, 8)), "as many keys"),
    (((1, 2, 2, 8), (1, 4, 6, 8), (1, 4, 6, 8)), "multiple of Hkv"),  # (SIGFPE)
    (((1, 2, 2, 8), (1, 2, 6, 4), (1, 2, 6, 8)), "head dim"),
])
def test_attention_with_lse_refuses_shapes_that_do_not_fit(shapes, match):
    """ATen's fused CPU kernel checks none of these: it read memory past k / v, or divided by zero."""
    from prefixlab.attention import attention_with_lse

    q, k, v = (torch.randn(shape) for shape in shapes)
    with pytest.raises(InvalidInputError, match=match):
        attention_with_lse(q, k, v)
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(InvalidInputError, match="mask must be bool"):
        attention_with_lse(q, k, v, torch.ones(1, 1, 2, 6))
    with pytest.raises(InvalidInputError, match="share a dtype"):
        attention_with_lse(q, k.double(), v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.3", True])
def test_the_other_public_kernels_refuse_a_scale_hydragen_attention_refuses(scale):
    """`varlen_prefill_attention` and `attention_with_lse` took any scale: NaN / inf gave NaN outputs without a
    word, True was read as 1.0, a string failed deep in torch (a TypeError / RuntimeError)."""
    from prefixlab.attention import attention_with_lse

    g = torch.Generator().manual_seed(3)
    q, k, v = _rand(g, 5, 4, 8), _rand(g, 5, 2, 8), _rand(g, 5, 2, 8)
    with pytest.raises(InvalidInputError, match="finite number"):
        varlen_prefill_attention(q, k, v, [2, 3], scale=scale, compiled=False)
    with pytest.raises(InvalidInputError, match="finite number"):
        attention_with_lse(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scale)
    # a numpy scale is the Python float it equals (as hydragen_attention takes it)
    by_numpy = varlen_prefill_attention(q, k, v, [2, 3], scale=np.float32(0.25), compiled=False)
    assert torch.equal(by_numpy, varlen_prefill_attention(q, k, v, [2, 3], scale=0.25, compiled=False))
