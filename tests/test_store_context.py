"""What changes a forward's numbers besides its tokens and weights, and what the store does about it: autocast is
refused, a changed float32 matmul precision empties the store, a changed config is refused, a RoPE that rescales
with the length is served only below its rescaling, and one request's unfit tensors do not cost the others."""

import warnings

import pytest
import torch
import transformers as tf
from hf_models import _COMMON, VOCAB, build, cache_argument

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.errors import InvalidInputError, ModelMismatchError
from prefixlab.recurrent import patch, unpatch


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache=None, new=4):
    out = model.generate(ids, **{cache_argument(model): cache}, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _assert_exact(got, want):
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


def _entries(store) -> list:
    return sorted((tuple(n.tokens.tolist()), tuple(n.ckpt_pos)) for n in store.core.tree.nodes())


@pytest.mark.parametrize("family", ["llama", "mamba2", "qwen3_5"])
def test_autocast_is_refused_before_the_store_is_asked(family):
    model = build(family)
    store = PrefixStore(model, capacity="64MB")
    prompt = _ids(30, 1)
    _generate(model, prompt, HybridPrefixCache(store))
    store.flush()
    before, stats = _entries(store), store.stats()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(InvalidInputError, match="autocast"):
        _generate(model, prompt, HybridPrefixCache(store))
    assert _entries(store) == before and store.stats()["sequences"] == stats["sequences"]
    _assert_exact(_generate(model, prompt, HybridPrefixCache(store)), _generate(build(family), prompt))
    store.close()


def test_patched_layers_refuse_autocast_clearly_without_a_store():
    model = patch(build("qwen3_5"))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(InvalidInputError, match="autocast"):
            model(_ids(12, 2))
    finally:
        unpatch(model)


def test_a_changed_float32_matmul_precision_empties_the_store():
    model = build("mamba2")
    store = PrefixStore(model, capacity="64MB")
    prompt = _ids(30, 3)
    _generate(model, prompt, HybridPrefixCache(store))
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if precision != "medium" else "highest")
        with pytest.warns(RuntimeWarning, match="float32 matmul precision"):
            cache = HybridPrefixCache(store)
            _generate(model, prompt, cache)
        assert cache.report().reused == 0
    finally:
        torch.set_float32_matmul_precision(precision)


def test_a_config_field_the_forward_reads_changed_after_the_store_was_built_is_refused(tmp_path):
    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    prompt = _ids(30, 4)
    _generate(model, prompt, HybridPrefixCache(store))
    model.config.output_hidden_states, model.config.pad_token_id = True, 5  # what a forward returns: it goes on
    _generate(model, prompt, HybridPrefixCache(store))
    store.save(tmp_path / "store.safetensors")  # and a file saved now loads for the model as it is
    PrefixStore.load(tmp_path / "store.safetensors", model).close()
    model.config.architectures = ["LlamaForCausalLM"]  # (what save_pretrained writes)
    _generate(model, prompt, HybridPrefixCache(store))
    model.resize_token_embeddings(VOCAB + 8)  # a config the store still serves: emptied, then exact
    with pytest.warns(RuntimeWarning, match="config changed"):
        cache = HybridPrefixCache(store)
        _assert_exact(_generate(model, prompt, cache), _generate(model, prompt))
    assert cache.report().reused == 0
    model.config.sliding_window = 8  # read by the mask at every forward: a model the store does not serve
    with pytest.raises(ModelMismatchError, match="config changed"):
        _generate(model, prompt, HybridPrefixCache(store))


def _rescaling_llama(kind: str):
    if kind == "longrope":
        rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                    long_factor=[float(2**i) for i in range(8)], original_max_position_embeddings=32)
        extra = dict(max_position_embeddings=128)
    else:
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
        extra = dict(max_position_embeddings=32)
    torch.manual_seed(0)
    config = tf.LlamaConfig(**(_COMMON | dict(num_hidden_layers=2) | extra | dict(rope_parameters=rope)))
    return tf.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_a_rope_that_rescales_with_the_length_is_served_below_its_rescaling_only(kind):
    model, plain = _rescaling_llama(kind), _rescaling_llama(kind)
    store = PrefixStore(model, capacity="64MB")
    assert store.rope_limit == 32
    system = _ids(20, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the rescaled frequencies are not new weights
        for i in range(6):  # short and long questions over one system prompt: long ones past the rescaling
            prompt, new = torch.cat([system, _ids(4 if i % 2 == 0 else 30, 50 + i)], dim=1), 2 + 2 * (i % 2)
            cache = HybridPrefixCache(store)
            _assert_exact(_generate(model, prompt, cache, new), _generate(plain, prompt, new=new))
            report = cache.report()
            if i % 2:  # the uncached model prefills it all at the rescaled frequencies: nothing reused or admitted
                assert report.reasons == ["refused_input"] and report.reused == 0
            else:
                assert report.reused == (20 if i else 0)
    # a short prompt decoding past the rescaling: only what ran below it is admitted
    cache = HybridPrefixCache(store)
    prompt = _ids(28, 9)
    _assert_exact(_generate(model, prompt, cache, new=8), _generate(plain, prompt, new=8))
    store.flush()
    assert max(len(tokens) for tokens, _ in _entries(store)) <= 31


def test_a_request_whose_tensors_do_not_fit_is_left_out_and_the_others_admitted():
    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    broken, fine = HybridPrefixCache(store), HybridPrefixCache(store)
    _generate(model, _ids(30, 6), broken)
    broken.layers[0].keys = broken.layers[0].keys.double()  # (as a model computing in another dtype would)
    with pytest.warns(RuntimeWarning, match="not admitted"):
        _generate(model, _ids(30, 7), fine)  # its lookup admits the open caches first
        store.flush()
    assert broken.report().admission.startswith("not admitted")
    assert fine.report().admitted_tokens > 0


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_a_later_forward_reaching_the_rescaling_neither_loads_nor_stores(kind):
    """A chat turn or a prefill chunk that reaches the rescaling runs all its tokens at the rescaled frequencies:
    the columns it computed were stored (a later short request 2.3e-3 off) and stored ones were loaded into it."""
    model, plain = _rescaling_llama(kind), _rescaling_llama(kind)
    store = PrefixStore(model, capacity="64MB")
    cache = HybridPrefixCache(store)
    first = _generate(model, _ids(10, 1), cache, new=2)[0]
    turn = torch.cat([first, _ids(25, 4)], dim=1)  # 37 tokens: this turn's forward is past the rescaling
    _generate(model, turn, cache, new=2)
    later = torch.cat([turn[:, :28], _ids(2, 9)], dim=1)  # 30 tokens: all at the original frequencies
    _assert_exact(_generate(model, later, HybridPrefixCache(store), new=3), _generate(plain, later, new=3))
    prompt = torch.cat([later[:, :28], _ids(12, 10)], dim=1)  # chunks of 24: the second reaches the rescaling
    chunked = dict(prefill_chunk_size=24)
    got = model.generate(prompt, past_key_values=HybridPrefixCache(store), max_new_tokens=3, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         **chunked)
    want = plain.generate(prompt, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **chunked)
    _assert_exact((got.sequences, torch.stack(got.logits)), (want.sequences, torch.stack(want.logits)))


def test_torchs_newer_precision_api_is_read_without_error():
    """After `torch.backends.cuda.matmul.fp32_precision = "tf32"` torch raises on the legacy getters
    (get_float32_matmul_precision, allow_tf32): every request and every new store raised a RuntimeError."""
    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    prompt = _ids(20, 8)
    _generate(model, prompt, HybridPrefixCache(store))
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # (no effect on CPU matmuls)
        with pytest.warns(RuntimeWarning, match="float32 matmul precision"):
            _generate(model, prompt, HybridPrefixCache(store))
        PrefixStore(model, capacity="1MB").close()
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert torch.get_float32_matmul_precision() in ("highest", "high", "medium")
