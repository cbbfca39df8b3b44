"""LSE-returning attention kernels and the partial-attention combine, against matmul + softmax references."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixlab.attention import attention_with_lse, attention_with_lse_reference, combine_partials, kernels
from prefixlab.errors import InvalidInputError

ATOL = 1e-5


def _qkv(seed, n=2, q_heads=4, kv_heads=2, m=5, length=7, dim=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, q_heads, m, dim, generator=g), torch.randn(n, kv_heads, length, dim, generator=g),
            torch.randn(n, kv_heads, length, dim, generator=g))


@pytest.mark.parametrize("masked", [False, True])
def test_cpu_kernel_matches_reference_and_sdpa(masked):
    q, k, v = _qkv(0)
    mask = None
    if masked:
        mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[0, 0, 2] = False  # a query that sees nothing
    out, lse = attention_with_lse(q, k, v, mask, scale=0.3)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, atol=ATOL, rtol=0)
    if masked:
        assert torch.isneginf(lse[0, :, 2]).all() and (out[0, :, 2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_matmul_kernel_folds_grouped_heads_and_matches_the_reference(dtype, masked):
    q, k, v = (t.to(dtype) for t in _qkv(2, q_heads=6, kv_heads=2, m=3, length=9))
    mask = None
    if masked:
        mask = torch.rand(2, 1, 3, 9, generator=torch.Generator().manual_seed(3)) > 0.5
        mask[1, 0, 0] = False  # a query that sees nothing
    out, lse = kernels.attention_with_lse_matmul(q, k, v, mask, 0.4)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, mask, 0.4)
    assert out.dtype == dtype and lse.dtype == kernels.accumulate_dtype(dtype)
    # bf16: the probabilities meet V in bf16, as in fused kernels; the scores and the LSE stay float32
    torch.testing.assert_close(out, ref_out, atol=1e-5 if dtype != torch.bfloat16 else 2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    if masked:
        assert torch.isneginf(lse[1, :, 0]).all() and (out[1, :, 0] == 0).all()


def test_cuda_kernel_choice_by_call_shape_and_setting(monkeypatch):
    monkeypatch.setattr(kernels, "_capability", lambda device: (9, 0))
    level = torch.zeros(1, 8, 4096, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 16384, 128, dtype=torch.bfloat16)
    suffix = torch.zeros(1024, 8, 4, 128, dtype=torch.bfloat16), torch.zeros(1024, 8, 256, 128, dtype=torch.bfloat16)
    assert kernels.cuda_lse_kernels(None) == kernels.DEFAULT_CUDA_LSE_KERNELS == {"long": "cudnn", "short": "cudnn"}
    assert kernels.cuda_lse_kernel_name(*level, None) == ("long", "cudnn")
    assert kernels.cuda_lse_kernel_name(*suffix, None) == ("short", "cudnn")
    # what a fused kernel cannot take goes to the kind's fallback: a mask, grouped heads, fp32, an older GPU
    mask = torch.ones(1, 1, 4096, 16384, dtype=torch.bool)
    assert kernels.cuda_lse_kernel_name(*level, mask) == ("long", "flex")
    assert kernels.cuda_lse_kernel_name(suffix[0], suffix[1], mask[:, :, :4, :256]) == ("short", "matmul")
    assert kernels.cuda_lse_kernel_name(level[0], level[1][:, :2], None) == ("long", "flex")
    assert kernels.cuda_lse_kernel_name(level[0].float(), level[1].float(), None) == ("long", "flex")
    monkeypatch.setattr(kernels, "_capability", lambda device: (7, 5))
    assert kernels.cuda_lse_kernel_name(*suffix, None) == ("short", "matmul")
    monkeypatch.setattr(kernels, "_capability", lambda device: (9, 0))
    setting = "long=flash, short=matmul"
    assert kernels.cuda_lse_kernels(setting) == {"long": "flash", "short": "matmul"}
    monkeypatch.setenv("PREFIXLAB_LSE_KERNELS", setting)
    assert kernels.cuda_lse_kernel_name(*level, None) == ("long", "flash")
    assert kernels.cuda_lse_kernel_name(*suffix, None) == ("short", "matmul")
    for bad in ("long=fast", "middle=flex", "cudnn"):
        with pytest.raises(InvalidInputError, match="PREFIXLAB_LSE_KERNELS"):
            kernels.cuda_lse_kernels(bad)


def test_a_fused_kernel_that_fails_warns_and_hands_its_calls_to_the_fallback(monkeypatch):
    calls = []

    def refuses(*args):
        calls.append("cudnn")
        raise RuntimeError("cuDNN Frontend error: no valid execution plans")

    monkeypatch.setattr(kernels, "_capability", lambda device: (9, 0))
    monkeypatch.setitem(kernels.CUDA_LSE_KERNELS, "cudnn", refuses)
    monkeypatch.setattr(kernels, "_failed_fused", set())
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(5, q_heads=2, kv_heads=2, m=2, length=8))
    with pytest.warns(RuntimeWarning, match="cudnn attention kernel failed.*matmul serves"):
        out, lse = kernels._attention_with_lse_cuda(q, k, v, None, 0.25)
    ref_out, ref_lse = kernels.attention_with_lse_matmul(q, k, v, None, 0.25)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    kernels._attention_with_lse_cuda(q, k, v, None, 0.25)  # not asked again
    assert calls == ["cudnn"] and kernels.cuda_lse_kernel_name(q, k, None) == ("short", "matmul")
    # a kernel that runs out of memory is not a kernel that cannot run: the error stands
    monkeypatch.setattr(kernels, "_failed_fused", set())
    monkeypatch.setitem(kernels.CUDA_LSE_KERNELS, "cudnn", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(torch.OutOfMemoryError):
        kernels._attention_with_lse_cuda(q, k, v, None, 0.25)


@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_cpu_kernel_reads_a_non_unit_stride_head_dim(operand):
    """A transposed K cache (or any tensor whose head dim is not unit-stride): the raw fused CPU kernel used to read it
    as if it were, giving outputs off by O(1) without an error."""
    qkv = dict(zip("qkv", _qkv(2), strict=True))
    ref_out, ref_lse = attention_with_lse_reference(*qkv.values(), None, scale=0.3)
    qkv[operand] = qkv[operand].transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, head dim strided
    out, lse = attention_with_lse(*qkv.values(), scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


def test_float64_stays_float64_through_the_lse_and_the_combine():
    q, k, v = (x.double() for x in _qkv(3))
    exact = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    halves = [attention_with_lse(q, k[:, :, part], v[:, :, part], scale=0.3) for part in (slice(0, 3), slice(3, 7))]
    assert all(lse.dtype == torch.float64 for _, lse in halves)
    merged = combine_partials(torch.stack([o for o, _ in halves]), torch.stack([lse for _, lse in halves]))
    torch.testing.assert_close(merged, exact, atol=1e-12, rtol=0)  # a float32 combine is off by ~1e-7


def test_kernel_refuses_empty_keys():
    q, k, v = _qkv(0, length=0)
    with pytest.raises(InvalidInputError, match="at least one key"):
        attention_with_lse(q, k, v)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(2, 24), parts=st.integers(2, 4), masked=st.booleans())
def test_combine_of_disjoint_key_sets_is_full_attention(seed, length, parts, masked):
    q, k, v = _qkv(seed, length=length)
    g = torch.Generator().manual_seed(seed + 1)
    owner = torch.randint(0, parts, (length,), generator=g)  # each key belongs to one part
    mask = torch.rand(2, 1, 5, length, generator=g) > 0.3 if masked else torch.ones(2, 1, 5, length, dtype=torch.bool)
    outs, lses = [], []
    for part in range(parts):
        keep = (owner == part).nonzero().flatten()
        if keep.numel() == 0:
            continue
        out, lse = attention_with_lse(q, k[:, :, keep], v[:, :, keep], mask[..., keep], scale=0.25)
        outs.append(out)
        lses.append(lse)
    combined = combine_partials(torch.stack(outs), torch.stack(lses))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(combined, full, atol=ATOL, rtol=0)


def test_combine_gives_zero_where_no_part_sees_anything():
    outs = torch.randn(3, 4, 8)
    lses = torch.full((3, 4), float("-inf"))
    lses[1, 0] = 0.5  # only query 0 sees something, in part 1
    combined = combine_partials(outs, lses)
    torch.testing.assert_close(combined[0], outs[1, 0])
    assert (combined[1:] == 0).all() and torch.isfinite(combined).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flex_kernel_and_hydragen_paths_match_reference():
    from prefixlab.attention import SharedLevel, hydragen_attention

    q, k, v = (t.cuda() for t in _qkv(0, m=8, length=40, dim=64))
    mask = (torch.rand(2, 1, 8, 40, generator=torch.Generator().manual_seed(1)) > 0.3).cuda()
    out, lse = attention_with_lse(q, k, v, mask, scale=0.2)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, mask, scale=0.2)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)
    level = SharedLevel(k[0], v[0])
    suffix_k, suffix_v = k[:, :, :16], v[:, :, :16]
    ref = hydragen_attention(q[:, :, :1], [level], suffix_k, suffix_v, method="sdpa")
    for method in ("split", "packed"):
        torch.testing.assert_close(hydragen_attention(q[:, :, :1], [level], suffix_k, suffix_v, method=method), ref,
                                   atol=ATOL, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(kernels.CUDA_LSE_KERNELS))
def test_each_cuda_lse_kernel_matches_the_reference_in_bf16(name):
    """Every kernel `PREFIXLAB_LSE_KERNELS` may pick, at a level call's shape (equal heads, no mask)."""
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(4, n=1, q_heads=4, kv_heads=4, m=96, length=300, dim=128))
    out, lse = kernels.CUDA_LSE_KERNELS[name](q, k, v, None, 128**-0.5)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, None, 128**-0.5)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.float(), ref_lse.float(), atol=1e-2, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("batch", "q_heads", "kv_heads", "dim", "queries", "ragged"), [
    (3, 8, 8, 64, 1, False),  # equal heads, d 64: cuDNN for both calls
    (5, 32, 8, 128, 1, True),  # 4:1 groups, ragged suffixes: the suffix call is masked (matmul)
    (4, 16, 2, 128, 5, False),  # several queries a sequence: causal suffix mask
    (64, 8, 1, 128, 1, False),  # one KV head, a long level: cuDNN's long call
])
def test_split_on_the_default_cuda_kernels_matches_sdpa_in_bf16(batch, q_heads, kv_heads, dim, queries, ragged):
    """Split on the kernels CUDA calls pick by default (cuDNN, flex or matmul where cuDNN cannot), over a two-level
    tree (a root every sequence sees, a child half of them see), against SDPA over each sequence's materialised KV."""
    from prefixlab.attention import SharedLevel, hydragen_attention

    g = torch.Generator(device="cuda").manual_seed(batch)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    levels = [SharedLevel(rand(kv_heads, 1000 + batch, dim), rand(kv_heads, 1000 + batch, dim)),
              SharedLevel(rand(kv_heads, 77, dim), rand(kv_heads, 77, dim), parent=0)]
    seq_levels = [i % 2 for i in range(batch)]
    suffix = 33
    lengths = [suffix - (i * 7) % 20 if ragged else suffix for i in range(batch)]
    args = (rand(batch, q_heads, queries, dim), levels, rand(batch, kv_heads, suffix, dim),
            rand(batch, kv_heads, suffix, dim))
    extra = dict(seq_levels=seq_levels, suffix_lengths=lengths if ragged else None)
    split = hydragen_attention(*args, **extra, method="split")
    expected = hydragen_attention(*args, **extra, method="sdpa")
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split.float(), expected.float(), atol=2e-2, rtol=2e-2)
