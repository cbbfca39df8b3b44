"""PrefixStore and its tensor payloads: capacity strings, KV split/concat, save/load, model identity."""

import functools

import numpy as np
import pytest
import torch
from hf_models import build
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixlab
from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.payload import KVPayload
from prefixlab.cache.store import CacheLayout, model_identity, parse_capacity
from prefixlab.cache.tensors import (
    TensorKV,
    TensorState,
    kv_from_flat,
    kv_to_flat,
    path_kv,
    state_from_flat,
    state_to_flat,
)
from prefixlab.errors import InvalidInputError, ModelMismatchError, UnsupportedModelError


@pytest.mark.parametrize(
    "text, nbytes",
    [("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GiB", 3 * 2**29), ("64kb", 64_000), ("100", 100),
     (4096, 4096), (np.int64(4096), 4096)],  # (a size computed with numpy)
)
def test_capacity_strings_and_ints(text, nbytes):
    assert parse_capacity(text) == nbytes


@pytest.mark.parametrize("bad", ["4 parsecs", "", "GB", "-1GB", 0, -5, 3.5, True, None, "0MB"])
def test_bad_capacity_raises_naming_the_argument(bad):
    with pytest.raises(InvalidInputError, match="capacity"):
        parse_capacity(bad)


def random_kv(ntokens: int, layers=(0, 3), seed=0) -> TensorKV:
    gen = torch.Generator().manual_seed(seed)
    return TensorKV(ntokens, {i: torch.randn(2, ntokens, 4, generator=gen) for i in layers},
                    {i: torch.randn(2, ntokens, 4, generator=gen) for i in layers})


@settings(max_examples=30, deadline=None)
@given(ntokens=st.integers(0, 40), data=st.data())
def test_kv_split_then_concat_is_the_identity_with_exact_bytes(ntokens, data):
    kv = random_kv(ntokens)
    at = data.draw(st.integers(0, ntokens))
    head, tail = kv.split(at)
    assert isinstance(kv, KVPayload)
    assert (head.ntokens, tail.ntokens) == (at, ntokens - at)
    assert head.nbytes + tail.nbytes == kv.nbytes == 2 * 2 * ntokens * 2 * 4 * 4
    joined = head.concat(tail)
    assert all(torch.equal(joined.keys[i], kv.keys[i]) and torch.equal(joined.values[i], kv.values[i]) for i in kv.keys)
    if 0 < at < ntokens:  # halves own their storage: evicting one frees exactly its bytes
        assert head.keys[0].untyped_storage().nbytes() == head.keys[0].nbytes


def _owns(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5), data=st.data())
def test_a_path_range_reads_only_the_pieces_it_overlaps_into_storage_of_its_own(lengths, data):
    pieces = [random_kv(n, seed=i) for i, n in enumerate(lengths)]
    total = sum(lengths)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    whole = functools.reduce(TensorKV.concat, pieces)
    # the pieces outside [start, stop) on the meta device: reading one of them would fail
    first, poisoned = 0, []
    for piece in pieces:
        inside = max(start, first) < min(stop, first + piece.ntokens)
        poisoned.append(piece if inside else piece.to("meta"))
        first += piece.ntokens
    for device in (None, "cpu"):
        got = path_kv(poisoned, device)(start, stop)
        assert got.ntokens == stop - start
        for layer in whole.keys:
            for side in ("keys", "values"):
                part, want = getattr(got, side)[layer], getattr(whole, side)[layer][:, start:stop]
                assert part.shape == want.shape and (start == stop or torch.equal(part, want) and _owns(part))


def test_the_store_keeps_no_view_of_a_larger_storage():
    """A capture path emitting states as views of one stacked tensor (mamba_ssm's varlen states, fla's in-chunk
    states) or KV as a view of a batch: stored as given, each kept state pinned the whole stack (2x the budget)."""
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="64MB")
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    model.generate(ids, past_key_values=HybridPrefixCache(store), max_new_tokens=1, do_sample=False)
    store.flush()
    node = next(n for n in store.core.tree.nodes() if n.ckpt_state)
    state = node.ckpt_state[0]
    stacked = {kind: {key: torch.stack([t, t, t])[1] for key, t in getattr(state, kind).items()}
               for kind in ("conv", "recurrent")}
    batch = {side: {layer: torch.stack([t[:, :1]] * 4)[2] for layer, t in getattr(node.kv, side).items()}
             for side in ("keys", "values")}
    tokens = np.concatenate([ids[0].numpy(), [7]])
    store.admit(tokens, kv=lambda a, b: TensorKV(b - a, batch["keys"], batch["values"]),
                states={len(tokens): TensorState(stacked["conv"], stacked["recurrent"])})
    for n in store.core.tree.nodes():
        tensors = [t for payload in n.ckpt_state for t in (*payload.conv.values(), *payload.recurrent.values())]
        kv = [] if n.kv is None else [*n.kv.keys.values(), *n.kv.values.values()]
        assert all(_owns(t) for t in [*tensors, *kv])


def test_kv_rejects_bad_shapes_and_split_points():
    with pytest.raises(InvalidInputError, match="no batch axis"):
        TensorKV(3, {0: torch.zeros(1, 2, 3, 4)}, {0: torch.zeros(1, 2, 3, 4)})
    with pytest.raises(InvalidInputError, match="split at"):
        random_kv(5).split(6)
    with pytest.raises(InvalidInputError, match="same attention layers"):
        random_kv(2, layers=(0,)).concat(random_kv(2, layers=(1,)))


def test_flat_names_round_trip():
    kv = random_kv(5)
    state = TensorState({(1, 0): torch.randn(6, 4)}, {(1, 0): torch.randn(2, 3, 3), (2, 0): torch.randn(1)})
    flat = kv_to_flat(kv, "n7") | state_to_flat(state, "n7.s5") | state_to_flat(state, "n17.s5")
    back_kv, back_state = kv_from_flat(flat, "n7", 5), state_from_flat(flat, "n7.s5")
    assert back_kv.nbytes == kv.nbytes and torch.equal(back_kv.values[3], kv.values[3])
    assert back_state.nbytes == state.nbytes and torch.equal(back_state.recurrent[(1, 0)], state.recurrent[(1, 0)])


def test_layout_and_bytes_match_the_models_own_cache():
    model = build("zamba2")  # has a layer holding both KV and recurrent states
    layout = CacheLayout.from_config(model.config)
    assert layout.kv_layers == (2,) and layout.state_layers == (0, 1, 2, 3)
    store = PrefixStore(model, capacity="16MB", policy="marconi", block_size=4)
    prompt = torch.randint(3, 128, (1, 10))
    model.generate(prompt, past_key_values=HybridPrefixCache(store), max_new_tokens=1, pad_token_id=0)
    store.flush()
    entry = store.core.match(prompt[0].tolist())
    assert entry.state.nbytes == store.spec.state_bytes
    assert sum(kv.nbytes for kv in entry.kv) == entry.length * store.spec.kv_bytes_per_token
    store.core.release(entry)


@pytest.mark.parametrize("family, window_type", [("qwen3", "sliding_attention"), ("lfm3", "sliding_attention"),
                                                 ("zaya", "hybrid_sliding"), ("inkling", "hybrid_sliding"),
                                                 ("inkling2", "hybrid_sliding")])
def test_sliding_window_models_are_refused(family, window_type):
    model = build(family)
    model.config.layer_types = [window_type, *model.config.layer_types[1:]]
    model.config.sliding_window = 8
    with pytest.raises(UnsupportedModelError, match=f"{window_type}.*bounded KV window"):
        PrefixStore(model)


def serve(model, store, prompt):
    cache = HybridPrefixCache(store)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out, cache.reused_tokens


def test_save_then_load_keeps_every_entry_and_stays_exact(tmp_path):
    model = build("qwen3_5")
    store = prefixlab.PrefixStore(model, capacity="8MB", policy="dp")
    prompts = [torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    for prompt in prompts * 2:
        serve(model, store, prompt)
    store.save(tmp_path / "store.safetensors")
    before = store.stats()
    store.close()
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    after = loaded.stats()
    assert (after["used_bytes"], after["checkpoints"]) == (before["used_bytes"], before["checkpoints"])
    assert after["capacity_bytes"] == 8 * 10**6 and after["policy"] == "dp"
    for prompt in prompts:
        out, reused = serve(model, loaded, prompt)
        assert reused == 29
        assert torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_load_for_another_model_raises_model_mismatch(tmp_path):
    model = build("qwen3_5")
    store = PrefixStore(model, capacity="8MB", policy="marconi")
    serve(model, store, torch.randint(3, 128, (1, 12)))
    store.save(tmp_path / "s.safetensors")
    store.close()
    assert model_identity(build("qwen3_5", seed=3)) == model_identity(model)  # weights are not part of identity
    with pytest.raises(ModelMismatchError, match="saved for a model"):
        PrefixStore.load(tmp_path / "s.safetensors", build("qwen3_5").double())
    other = build("qwen3_5")
    other.config.rope_parameters = {**other.config.rope_parameters, "rope_theta": 5.0}
    with pytest.raises(ModelMismatchError, match="saved for a model"):
        PrefixStore.load(tmp_path / "s.safetensors", other)
    with pytest.raises(InvalidInputError, match="not a file"):
        PrefixStore.load(tmp_path / "missing.safetensors", model)


def test_store_rejects_what_is_not_a_model():
    with pytest.raises(InvalidInputError, match="transformers model"):
        PrefixStore(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("offload,change", [(None, "step"), ("64MB", "step"), (None, "data"), (None, "buffer"),
                                            (None, "inference"), (None, "assign"), (None, "layer"), (None, "dict"),
                                            (None, "fused")])
def test_entries_computed_with_other_weights_are_dropped_before_any_reuse(offload, change):
    """An optimizer step between requests (RL rollouts, online fine-tuning), or new tensors assigned to `.data` (weight
    syncing code does): before, the next request resumed KV and states of the old weights. Now the store notices
    (version counters, storage addresses) and empties both tiers, with a warning."""
    import recurrent_patch_models  # unit-scale weights: a stale state shows in the tokens

    if change == "inference":  # parameters made under inference_mode have no version counter: their values count
        with torch.inference_mode():
            model = recurrent_patch_models.build("qwen3_5_text", seed=3)
    else:
        model = recurrent_patch_models.build("qwen3_5_text", seed=3)
    store = PrefixStore(model, capacity="64MB", offload_capacity=offload)
    prompt = torch.randint(3, 60, (1, 25), generator=torch.Generator().manual_seed(0))

    def generate(cache=None):
        extra = {} if cache is None else {"past_key_values": cache}
        return model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)

    generate(HybridPrefixCache(store))
    if change in ("step", "fused"):  # (a fused optimizer writes weights without a version count)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True) if change == "fused" else \
            torch.optim.SGD(model.parameters(), lr=0.05)
        model(input_ids=prompt, labels=prompt).loss.backward()
        optimizer.step()
    elif change == "buffer":  # buffers were not looked at (RoPE frequencies, MoE score biases)
        next(b for name, b in model.named_buffers() if name.endswith("inv_freq")).mul_(1.5)
    elif change == "inference":
        with torch.inference_mode():
            model.load_state_dict(recurrent_patch_models.build("qwen3_5_text", seed=4).state_dict())
    elif change in ("assign", "layer", "dict"):  # new tensor or module objects (the store keeps its walk of the model)
        other = recurrent_patch_models.build("qwen3_5_text", seed=4)
        if change == "assign":
            model.load_state_dict(other.state_dict(), assign=True)
        elif change == "layer":
            model.model.layers[0].mlp = other.model.layers[0].mlp
        else:
            model.lm_head._parameters["weight"] = other.lm_head.weight
    else:
        noise = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.data = param.data + 0.05 * torch.randn(param.shape, generator=noise)
    cache = HybridPrefixCache(store)
    with pytest.warns(RuntimeWarning, match="weights changed"):
        assert torch.equal(generate(cache), generate())
    assert cache.reused_tokens == 0 and store.stats()["sequences"] == 2  # counters are kept
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(cache), generate()) and cache.reused_tokens == 24  # the new weights' entries


@pytest.mark.parametrize("clear", ["weights", "explicit"])
def test_a_request_pending_when_the_store_was_cleared_is_never_admitted(clear):
    """A request's cache is admitted at the store's next use: one that began before the weights changed (or before
    store.clear()) must not be admitted after the clear, else its old-weights KV and states are reused."""
    import recurrent_patch_models  # unit-scale weights: a stale state shows in the tokens

    model = recurrent_patch_models.build("qwen3_5_text", seed=3)
    store = PrefixStore(model, capacity="64MB")
    prompt = torch.randint(3, 60, (1, 25), generator=torch.Generator().manual_seed(0))

    def generate(cache=None, ids=prompt):
        extra = {} if cache is None else {"past_key_values": cache}
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)

    stale = HybridPrefixCache(store)
    generate(stale)  # held, not admitted yet
    for param in model.parameters():
        param.data = param.data * 1.05
    if clear == "explicit":
        store.clear()
    else:
        with pytest.warns(RuntimeWarning, match="weights changed"):
            generate(HybridPrefixCache(store), prompt.flip(1))
    assert "not admitted" in str(stale.report())
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(cache), generate()) and cache.reused_tokens == 0

def test_clear_empties_the_store_between_requests_only():
    model = build("llama")
    store = PrefixStore(model, capacity="64MB")
    prompt = torch.arange(3, 23)[None]
    model(input_ids=prompt, past_key_values=HybridPrefixCache(store))
    match = store.match(prompt[0].tolist())
    assert match.length == 20
    with pytest.raises(InvalidInputError, match="between requests"):
        store.clear()
    store.release(match)
    store.clear()
    assert store.core.used_bytes == 0 and store.stats()["requests"] == 0
    match = store.match(prompt[0].tolist())
    assert match.length == 0
    store.release(match)


def test_a_store_is_not_copied_or_pickled():
    """copy.copy(store) shared the original's core; closing the copy gave back the original's kernel-patch share, so
    a Jamba store then refused every request; pickle raised a TypeError about a lock."""
    import copy
    import pickle

    store = PrefixStore(build("qwen3_5"), capacity="64MB")
    for make in (copy.copy, copy.deepcopy, pickle.dumps):
        for thing in (store, HybridPrefixCache(store)):
            with pytest.raises(InvalidInputError, match="not copied"):
                make(thing)


def test_a_config_of_a_patched_only_family_without_recurrent_layers_serves_kv():
    """A Jamba config whose every layer is attention: every request was refused because "its layers' patch was taken
    off", a patch it never needed."""
    import transformers
    from hf_models import _COMMON

    config = transformers.JambaConfig(**_COMMON, num_hidden_layers=2, attn_layer_period=1, attn_layer_offset=0,
                                      num_experts=1, expert_layer_period=1, expert_layer_offset=0)
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(config).eval()
    store, prompt = PrefixStore(model, capacity="64MB"), torch.randint(3, 100, (1, 12))
    generate = functools.partial(model.generate, prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    generate(past_key_values=HybridPrefixCache(store))
    cache = HybridPrefixCache(store)
    assert torch.equal(generate(past_key_values=cache), generate()) and cache.reused_tokens == 11


def test_buffers_rewritten_in_place_with_the_same_values_keep_the_store():
    """longrope copies its inv_freq buffer in place at every forward (same values): counted by version, buffers made
    the store empty itself at every request (no reuse at all)."""
    import warnings

    import transformers
    from hf_models import _COMMON

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(_COMMON | {"num_hidden_layers": 2,
                                                                                  "rope_parameters": rope}))).eval()
    store, prompt = PrefixStore(model, capacity="64MB", block_size=4), torch.randint(3, 100, (1, 20))
    generate = functools.partial(model.generate, prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no "weights changed")
        generate(past_key_values=HybridPrefixCache(store))
        cache = HybridPrefixCache(store)
        assert torch.equal(generate(past_key_values=cache), generate()) and cache.reused_tokens == 19
