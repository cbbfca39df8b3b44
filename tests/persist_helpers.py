"""Shared by tests/test_persist*.py: a saved store with both tiers, and what compares stores."""

import json
import struct

import pytest
import torch
from hf_models import build
from safetensors.torch import save_file

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache import digests
from prefixlab.cache.tensors import path_kv
from prefixlab.errors import CorruptStoreError

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
    return {str(key): (str(t.dtype), tuple(t.shape), digests.digest(digests.raw_bytes(t))) for key, t in
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


def safetensors_header(path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file: 8 bytes of header length, then the header."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return 8 + length, json.loads(data[8:8 + length])


def write_store_file(path, tensors: dict, header: dict) -> None:
    """Write `tensors` and `header` to `path` as save does, with a matching checksum (a well-formed file)."""
    text = json.dumps(header)
    save_file(tensors, path, metadata={"prefixlab": text, "prefixlab.blake2b": digests.digest(text.encode())})


def assert_refused_untouched(model, path, tensors: dict, header: dict) -> None:
    """Write `tensors` and `header` to `path` with a matching checksum: load refuses it, the model untouched."""
    write_store_file(path, tensors, header)
    untouched = model_state(model)
    with pytest.raises(CorruptStoreError, match=path.name):
        PrefixStore.load(path, model)
    assert model_state(model) == untouched


def stream(seed: int, count: int) -> list[torch.Tensor]:
    """Prompts sharing heads of three depths, then their own tokens: a 60 kB dp store evicts and tunes in a few."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 128, (1, 12), generator=generator)
    return [torch.cat([head[:, :4 + 4 * (i % 3)], torch.randint(3, 128, (1, 10), generator=generator)], 1)
            for i in range(count)]
