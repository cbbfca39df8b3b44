"""PrefixStore.save / PrefixStore.load (cache/persist.py): exact round trips of both tiers, the weights fingerprint,
per-tensor checksums, damaged files, atomic writes, and loads that fail leaving the model untouched."""

import json
import os
import struct

import pytest
import torch
from hf_models import build
from safetensors.torch import load_file, save_file

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache import persist
from prefixlab.cache.tensors import path_kv
from prefixlab.errors import CorruptStoreError, InvalidInputError, ModelMismatchError

FAMILY = "qwen3_5"  # attention + GatedDeltaNet: KV and recurrent states in every entry
PROMPTS = [torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(s)) for s in range(3)]
NAMESPACES = ["default", "default", "tenant-a"]


def generate(model, prompt, store=None, namespace="default"):
    cache = {} if store is None else {"past_key_values": HybridPrefixCache(store, namespace=namespace)}
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, **cache)
    return out, cache["past_key_values"].reused_tokens if cache else 0


def model_state(model) -> tuple:
    """What a store leaves on a model: its hooks and the patch flag."""
    return len(model._forward_pre_hooks), len(model._forward_hooks), getattr(model, "prefixlab_patched", False)


def digest_tensors(payload) -> dict:
    tensors = {**getattr(payload, "keys", {}), **{("v", k): t for k, t in getattr(payload, "values", {}).items()},
               **getattr(payload, "conv", {}), **{("r", k): t for k, t in getattr(payload, "recurrent", {}).items()}}
    return {str(key): (str(t.dtype), tuple(t.shape), persist.digest(persist.raw_bytes(t))) for key, t in
            tensors.items()}


def contents(core) -> dict:
    """Per leaf path: namespace, tokens -> digests of its KV and of every checkpoint on the path (tier contents up to
    how the tree happens to split its edges)."""
    found = {}
    for leaf in core.tree.nodes():
        if leaf.is_root or leaf.children:
            continue
        path, node = [], leaf
        while not node.is_root:
            path.append(node)
            node = node.parent
        path.reverse()
        tokens = tuple(t for n in path for t in n.tokens.tolist())
        states = {p: digest_tensors(s) for n in path for p, s in zip(n.ckpt_pos, n.ckpt_state, strict=True)}
        found[(leaf.namespace, tokens)] = (digest_tensors(path_kv([n.kv for n in path])(0, len(tokens))), states)
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A store whose device tier holds one entry and whose host tier holds the two it evicted, saved to a file."""
    model = build(FAMILY)
    # marconi: the expected tiers below are its evictions (dp would thin an entry's states and keep two on the device)
    store = PrefixStore(model, capacity=100_000, offload_capacity="1MB", block_size=4, policy="marconi")
    for prompt, namespace in zip(PROMPTS, NAMESPACES, strict=True):
        generate(model, prompt, store, namespace)
    path = tmp_path_factory.mktemp("persist") / "store.safetensors"
    store.save(path)
    stats, tiers = store.stats(), (contents(store.core), contents(store.offload))
    store.close()
    assert stats["used_bytes"] > 0 and stats["offload_used_bytes"] > 0 and len(tiers[1]) >= 2
    return model, path, stats, tiers


@pytest.fixture
def copied(saved, tmp_path):
    """A fresh copy of the saved file, which the test may damage."""
    path = tmp_path / "store.safetensors"
    path.write_bytes(saved[1].read_bytes())
    return path


def test_round_trip_restores_both_tiers_bit_for_bit_and_stays_exact(saved):
    model, path, before, tiers = saved
    loaded = PrefixStore.load(path, model)
    after = loaded.stats()
    for key in ("capacity_bytes", "used_bytes", "checkpoints", "offload_capacity_bytes", "offload_used_bytes"):
        assert after[key] == before[key], key
    assert (contents(loaded.core), contents(loaded.offload)) == tiers
    assert {namespace for namespace, _ in tiers[0] | tiers[1]} == set(NAMESPACES)
    for prompt, namespace in zip(PROMPTS, NAMESPACES, strict=True):
        out, reused = generate(model, prompt, loaded, namespace)
        assert reused == 29
        assert torch.equal(out, generate(model, prompt)[0])
    assert loaded.stats()["offload_hits"] >= 2  # the two host-tier entries were served from the host tier
    loaded.close()


def test_vllm_round_trip_keeps_a_partial_block_state_inside_a_longer_path(tmp_path):
    # the second, shorter request of the same prompt ends inside a block of the first one's path; load re-admits
    # that path whole, and must not let its deeper states supersede the shorter one's end state
    model = build(FAMILY)
    store = PrefixStore(model, capacity="64MB", policy="vllm+", block_size=4)
    prompt = PROMPTS[0][:, :10]
    generate(model, prompt, store)  # prompt + 3 outputs: states at 4, 8, 12, 13
    model.generate(prompt, past_key_values=HybridPrefixCache(store), max_new_tokens=1, do_sample=False,
                   pad_token_id=0)  # the prompt alone: its end state at 10, inside the block [8, 12)
    store.flush()
    checkpoints = sorted(p for node in store.core.tree.nodes() for p in node.ckpt_pos)
    assert 10 in checkpoints
    store.save(tmp_path / "store.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    assert sorted(p for node in loaded.core.tree.nodes() for p in node.ckpt_pos) == checkpoints
    loaded.close()


def test_host_entries_go_to_the_device_tier_of_a_store_without_one(saved):
    model, path, _, tiers = saved
    loaded = PrefixStore.load(path, model, capacity="1MB", offload_capacity=None)
    assert loaded.offload is None
    assert contents(loaded.core) == tiers[0] | tiers[1]
    for prompt, namespace in zip(PROMPTS, NAMESPACES, strict=True):
        out, reused = generate(model, prompt, loaded, namespace)
        assert reused == 29 and torch.equal(out, generate(model, prompt)[0])
    loaded.close()


def test_entries_that_do_not_fit_are_dropped_with_one_warning(saved):
    model, path, _, tiers = saved
    with pytest.warns(RuntimeWarning, match=r"more than the loaded store's capacity: 2 of its 3 entries") as caught:
        loaded = PrefixStore.load(path, model, offload_capacity=None)
    assert len(caught) == 1
    assert contents(loaded.core) == tiers[0]  # device entries are admitted last: they win the device budget
    loaded.close()


def flip_one_bit(param: torch.Tensor, index: int = 0) -> None:
    with torch.no_grad():
        param.view(-1).view(torch.int32)[index] ^= 1  # the lowest mantissa bit of one fp32 weight


def test_a_fine_tune_with_the_same_config_is_rejected_naming_what_differs(saved):
    _, path, _, _ = saved
    tuned = build(FAMILY)
    flip_one_bit(tuned.lm_head.weight, 7)
    untouched = model_state(tuned)
    with pytest.raises(ModelMismatchError, match=r"same config and dtype but other weights \(1 differ: lm_head.weight"):
        PrefixStore.load(path, tuned)
    assert model_state(tuned) == untouched


def test_another_model_is_rejected_and_left_untouched(saved):
    _, path, _, _ = saved
    for other in (build("llama"), build(FAMILY).to(torch.bfloat16)):
        untouched = model_state(other)
        with pytest.raises(ModelMismatchError, match="saved for a model with identity"):
            PrefixStore.load(path, other)
        assert model_state(other) == untouched


def test_weights_fingerprint_sees_one_bit_of_any_parameter_or_buffer():
    model = build(FAMILY)
    base = persist.weights_fingerprint(model)
    assert base == persist.weights_fingerprint(build(FAMILY))
    buffers = dict(model.named_buffers())
    assert buffers and set(buffers) | {name for name, _ in model.named_parameters()} == set(base)
    for name, tensor in [("model.embed_tokens.weight", model.model.embed_tokens.weight), *buffers.items()][:2]:
        flip_one_bit(tensor, tensor.numel() - 1)
        changed = persist.weights_fingerprint(model)
        assert {key for key in base if base[key] != changed[key]} == {name}
        flip_one_bit(tensor, tensor.numel() - 1)
    assert persist.weights_fingerprint(model) == base
    assert persist.weights_fingerprint(model.to(torch.bfloat16)) != base  # bf16 bytes are hashed too


def test_the_fingerprint_is_computed_once_per_store(saved, tmp_path, monkeypatch):
    model, path, _, _ = saved
    calls = []
    original = persist.weights_fingerprint
    monkeypatch.setattr(persist, "weights_fingerprint", lambda m: calls.append(m) or original(m))
    loaded = PrefixStore.load(path, model)  # load fingerprints the model it is given
    loaded.save(tmp_path / "a.safetensors")
    loaded.save(tmp_path / "b.safetensors")
    loaded.close()
    assert len(calls) == 1



@pytest.mark.parametrize("saved_before", [False, True], ids=["first-save", "second-save"])
def test_a_save_after_the_weights_changed_holds_only_the_new_weights_entries(tmp_path, saved_before):
    """Weights that change under a store (an optimizer step) make its entries stale: a save must neither write them
    under the new weights' fingerprint nor write new entries under the fingerprint of an earlier save."""
    model = build(FAMILY)
    store = PrefixStore(model, capacity="64MB", block_size=4)
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    generate(model, PROMPTS[0], store)
    if saved_before:
        store.save(tmp_path / "before.safetensors")
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.05)
    if saved_before:  # the next request notices, empties the store and admits the new weights' entry
        with pytest.warns(RuntimeWarning, match="weights changed"):
            generate(model, PROMPTS[0], store)
        store.save(tmp_path / "s.safetensors")
    else:
        with pytest.warns(RuntimeWarning, match="weights changed"):
            store.save(tmp_path / "s.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "s.safetensors", model)
    expected, _ = generate(model, PROMPTS[0])
    out, reused = generate(model, PROMPTS[0], loaded)
    assert torch.equal(out, expected) and reused == (29 if saved_before else 0)
    loaded.close()
    old = build(FAMILY)
    old.load_state_dict(original)
    with pytest.raises(ModelMismatchError, match="other weights"):
        PrefixStore.load(tmp_path / "s.safetensors", old)

def safetensors_header(path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file: 8 bytes of header length, then the header."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return 8 + length, json.loads(data[8:8 + length])


def tensor_span(path, name: str) -> tuple[int, int]:
    """Byte range of tensor `name`'s data in a safetensors file."""
    start, header = safetensors_header(path)
    begin, end = header[name]["data_offsets"]
    return start + begin, start + end


@pytest.mark.parametrize("kind", ["device.n", "host.n"])
@pytest.mark.parametrize("part", [".k.", ".recurrent."])
def test_a_flipped_bit_in_any_tensor_is_rejected_naming_tensor_and_file(saved, copied, kind, part):
    model = saved[0]
    name = next(n for n in load_file(copied) if n.startswith(kind) and part in n)
    begin, end = tensor_span(copied, name)
    data = bytearray(copied.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    copied.write_bytes(bytes(data))
    untouched = model_state(model)
    with pytest.raises(CorruptStoreError, match=rf"tensor '{name}' in .*{copied.name} does not match its checksum"):
        PrefixStore.load(copied, model)
    assert model_state(model) == untouched


def test_a_flipped_bit_in_the_header_is_rejected(saved, copied):
    data = bytearray(copied.read_bytes())
    at = data.index(b"tokens")
    at += next(i for i, byte in enumerate(data[at:]) if chr(byte).isdigit())
    data[at] ^= 0x01  # another digit: the JSON stays valid, a token id changes
    copied.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="header of .* does not match its checksum"):
        PrefixStore.load(copied, saved[0])


@pytest.mark.parametrize("keep", [lambda n: n - 1, lambda n: n // 2, lambda n: 4, lambda n: 0])
def test_a_truncated_file_raises_the_librarys_error(saved, copied, keep):
    data = copied.read_bytes()
    copied.write_bytes(data[:keep(len(data))])
    with pytest.raises(CorruptStoreError, match="not a complete safetensors file"):
        PrefixStore.load(copied, saved[0])


@pytest.mark.parametrize("garbage", [os.urandom(4096), b'{"not": "a store"}', b"\x10" + bytes(4095)])
def test_a_garbage_file_raises_the_librarys_error(saved, tmp_path, garbage):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(garbage)
    with pytest.raises(CorruptStoreError, match="garbage.safetensors"):
        PrefixStore.load(path, saved[0])


def test_files_not_written_by_this_version_are_refused(saved, copied, tmp_path):
    tensors = load_file(copied)
    save_file(tensors, tmp_path / "plain.safetensors")
    with pytest.raises(InvalidInputError, match="no prefixlab header"):
        PrefixStore.load(tmp_path / "plain.safetensors", saved[0])
    save_file(tensors, tmp_path / "old.safetensors", metadata={"prefixlab": '{"identity": "x", "nodes": []}'})
    with pytest.raises(InvalidInputError, match="older prefixlab without checksums"):
        PrefixStore.load(tmp_path / "old.safetensors", saved[0])


def test_a_load_failing_after_the_store_is_built_unhooks_and_unpatches(saved, monkeypatch):
    model = saved[0]
    untouched = model_state(model)
    assert untouched == (0, 0, False)

    def fail(store, entries):
        assert store.records_in_kernel  # the store patched the model before admitting
        raise KeyError("boom")

    monkeypatch.setattr(persist, "_admit", fail)
    with pytest.raises(CorruptStoreError, match="inconsistent entries"):
        PrefixStore.load(saved[1], model)
    assert model_state(model) == untouched


def test_a_failed_save_leaves_the_previous_file_intact_and_no_temporary_file(saved, copied, monkeypatch):
    model, _, _, _ = saved
    good = copied.read_bytes()
    store = PrefixStore.load(copied, model)
    generate(model, torch.randint(3, 128, (1, 20)), store)  # something new to save

    def write_half_then_fail(tensors, filename, metadata):
        save_file(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as file:
            file.truncate(os.path.getsize(filename) // 2)
        raise OSError("No space left on device")

    monkeypatch.setattr(persist, "save_file", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.save(copied)
    assert copied.read_bytes() == good and os.listdir(copied.parent) == [copied.name]
    monkeypatch.undo()
    store.save(copied)  # a save that succeeds replaces the file
    assert copied.read_bytes() != good and os.listdir(copied.parent) == [copied.name]
    store.close()
    PrefixStore.load(copied, model).close()


def test_save_refuses_a_path_in_a_missing_directory(saved, tmp_path):
    store = PrefixStore(saved[0])
    with pytest.raises(InvalidInputError, match="existing directory"):
        store.save(tmp_path / "missing" / "store.safetensors")
    store.close()


def test_bf16_entries_round_trip_bit_for_bit(tmp_path):
    model = build(FAMILY).to(torch.bfloat16)
    store = PrefixStore(model, capacity="1MB", block_size=4)
    generate(model, PROMPTS[0], store)
    store.save(tmp_path / "bf16.safetensors")
    saved_contents = contents(store.core)
    store.close()
    loaded = PrefixStore.load(tmp_path / "bf16.safetensors", model)
    assert contents(loaded.core) == saved_contents and saved_contents
    loaded.close()


def assert_refused_untouched(model, path, tensors: dict, header: dict) -> None:
    """Write `tensors` and `header` to `path` with a matching checksum: load refuses it, the model untouched."""
    text = json.dumps(header)
    save_file(tensors, path, metadata={"prefixlab": text, "prefixlab.blake2b": persist.digest(text.encode())})
    untouched = model_state(model)
    with pytest.raises(CorruptStoreError, match=path.name):
        PrefixStore.load(path, model)
    assert model_state(model) == untouched


@pytest.mark.parametrize("edit", [
    lambda h: h.pop("weights"),
    lambda h: h.update(weights=[]),
    lambda h: h.update(tiers={"elsewhere": []}),
    lambda h: h["tiers"]["device"][0].pop("leaf"),
    lambda h: h["tiers"]["device"][0].update(parent=10**6),
    lambda h: h["tiers"]["host"][0].update(tokens=h["tiers"]["host"][0]["tokens"][:-1]),
    lambda h: h.update(capacity_bytes=-1),
    lambda h: h.update(capacity_bytes="4GB"),
    lambda h: h.update(policy="lru"),
    lambda h: h.update(block_size=0),
    lambda h: h.update(offload_capacity_bytes=1.5),
])
def test_a_well_formed_file_with_an_inconsistent_header_raises_the_librarys_error(saved, copied, edit):
    """Headers whose checksum matches but whose content does not (written by something else): CorruptStoreError."""
    model = saved[0]
    tensors, header = load_file(copied), json.loads(safetensors_header(copied)[1]["__metadata__"]["prefixlab"])
    edit(header)
    assert_refused_untouched(model, copied, tensors, header)


@pytest.mark.parametrize("edit", ["drop recurrent", "drop conv", "kv float16", "conv shape", "identity null"])
def test_a_well_formed_file_with_payloads_that_do_not_fit_the_model_is_refused(saved, copied, edit):
    """`load` admitted saved tensors without the checks `PrefixStore.admit` makes: a state missing one layer's
    recurrent or conv state was loaded (logits 5e-3 / 3e-2 off), KV in another dtype too, a state of another shape
    failed later requests."""
    model = saved[0]
    tensors, header = load_file(copied), json.loads(safetensors_header(copied)[1]["__metadata__"]["prefixlab"])
    recurrent = next(n for n in sorted(tensors) if n.startswith("device.") and ".recurrent.0." in n)
    target = recurrent if edit == "drop recurrent" else recurrent.replace("recurrent", "conv") if "conv" in edit \
        else next(n for n in sorted(tensors) if n.startswith("device.") and ".k." in n)
    if edit.startswith("drop"):
        del tensors[target], header["tensors"][target]
    elif edit == "identity null":
        header["identity"] = None
    else:
        tensors[target] = tensors[target].half() if edit == "kv float16" else tensors[target][..., 1:].contiguous()
        header["tensors"][target] = [str(tensors[target].dtype), list(tensors[target].shape),
                                     persist.tensor_digests({target: tensors[target]})[target]]
    assert_refused_untouched(model, copied, tensors, header)


def test_a_store_too_big_for_one_file_is_refused_clearly(saved, copied, monkeypatch):
    """safetensors caps a file's header at 100 MB (about 20k entries): save raised its raw "header too large"."""
    from safetensors import SafetensorError

    def too_large(*_, **__):
        raise SafetensorError("Error while serializing: header too large")

    model, before = saved[0], copied.read_bytes()
    store = PrefixStore.load(copied, model)
    monkeypatch.setattr(persist, "save_file", too_large)
    with pytest.raises(InvalidInputError, match="do not fit one safetensors file.*header too large.*smaller store"):
        store.save(copied)
    assert copied.read_bytes() == before and [p.name for p in copied.parent.iterdir()] == [copied.name]
    store.close()
