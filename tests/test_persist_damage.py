"""PrefixStore.save / PrefixStore.load with damaged files (flipped bits, truncations, garbage, inconsistent headers)
and failing saves and loads: the library's error naming the file, the model untouched, the previous file intact."""

import json
import os

import persist_helpers
import pytest
import torch
from hf_models import build
from persist_helpers import (
    FAMILY,
    PROMPTS,
    assert_refused_untouched,
    contents,
    generate,
    model_state,
    safetensors_header,
)
from safetensors.torch import load_file, save_file

from prefixlab import PrefixStore
from prefixlab.cache import digests, persist
from prefixlab.errors import CorruptStoreError, InvalidInputError

saved, copied = persist_helpers.saved, persist_helpers.copied  # (the fixtures, by name)


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

    def fail(store, entries, rebuilt):
        assert store.records_in_kernel  # the store patched the model before admitting
        raise KeyError("boom")

    monkeypatch.setattr(persist, "admit_entries", fail)
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
    lambda h: h.update(alpha=0.5),
    lambda h: h.update(alpha={"device": -1.0}),
    lambda h: h.update(alpha={"device": float("nan")}),
    lambda h: h.update(alpha={"device": True}),
    lambda h: h.update(alpha={"elsewhere": 0.5}),
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
                                     digests.tensor_digests({target: tensors[target]})[target]]
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


def test_a_file_system_error_while_saving_is_not_called_a_store_too_big(saved, copied, monkeypatch):
    """safetensors reports a failed write as a SafetensorError too: a full disk or a folder nothing can be created
    in (/proc) was reported as "N tensors ... do not fit one safetensors file ... save a smaller store"."""
    from safetensors import SafetensorError

    def disk_full(*_, **__):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    model, before = saved[0], copied.read_bytes()
    store = PrefixStore.load(copied, model)
    monkeypatch.setattr(persist, "save_file", disk_full)
    with pytest.raises(OSError, match=r"cannot write .*No space left on device.*was left as it was") as raised:
        store.save(copied)
    assert "do not fit" not in str(raised.value)
    assert copied.read_bytes() == before and [p.name for p in copied.parent.iterdir()] == [copied.name]
    monkeypatch.undo()
    if os.path.isdir("/proc/self"):  # (Linux: procfs takes no new file, even from root)
        with pytest.raises(OSError, match=r"cannot write '/proc/store.safetensors'"):
            store.save("/proc/store.safetensors")
    store.close()


def test_save_and_load_refuse_what_is_not_a_path_or_a_model_clearly(saved, copied):
    """A path that is no path (TypeError), a model that is none (AttributeError) or torch.compile's wrapper (blamed
    on other weights: "58 only in the file ... 58 only in this model") were raw errors or misleading ones."""
    model = saved[0]
    store = PrefixStore.load(copied, model)
    for path in (5, None):
        with pytest.raises(InvalidInputError, match=r"path=.* must be a file path \(a str or os.PathLike\)"):
            store.save(path)
        with pytest.raises(InvalidInputError, match=r"path=.* must be a file path \(a str or os.PathLike\)"):
            PrefixStore.load(path, model)
    store.close()
    untouched = model_state(model)
    with pytest.raises(InvalidInputError, match="model must be a transformers model, got NoneType"):
        PrefixStore.load(copied, None)
    with pytest.raises(InvalidInputError, match=r"given the module torch.compile returned.*original model"):
        PrefixStore.load(copied, torch.compile(model))
    assert model_state(model) == untouched
