"""A store loaded as it was saved serves on exactly as the saved one (cache/persist.py "Restart", cache/restore.py):
the same tree, policy state, hits and outputs; files without a policy state load as before; a damaged one is
refused, the model left untouched."""

import json

import pytest
import torch
from hf_models import build, cache_argument
from persist_helpers import FAMILY, assert_refused_untouched, generate, safetensors_header, stream, write_store_file
from safetensors.torch import load_file

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.restore import preorder
from prefixlab.errors import CorruptStoreError

OPTIONS = {"capacity": 60_000, "offload_capacity": 120_000, "block_size": 4, "policy": "dp",
           "tuning_lag_requests": 0}


@pytest.fixture(scope="module")
def model():
    return build(FAMILY)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """A dp store with both tiers, tuned and evicting, saved; and the store, left as it was saved."""
    store = PrefixStore(model, **OPTIONS)
    for prompt in stream(4, 30):
        generate(model, prompt, store)
    store.flush()
    assert store.core.bootstrap is None and store.offload.bootstrap is None and store.core.evictions > 0
    path = tmp_path_factory.mktemp("restart") / "store.safetensors"
    store.save(path)
    yield store, path
    store.close()


def tier_state(core) -> list:
    """Everything of a tier the policy reads: its nodes as they are and the admission's laws."""
    nodes = [(n.id, n.namespace, n.start, n.end, n.ckpt_pos, n.last_access, n.recent_resumes, n.branched,
              n.resumed) for n in preorder(core.tree)]
    law = getattr(core.admission, "law", None)
    return [core.clock, nodes, None if law is None else (law.seen, law.reused, law.stints), core.alpha]


def serve(model, store, prompts) -> list[tuple[torch.Tensor, int]]:
    return [generate(model, prompt, store) for prompt in prompts]


def test_a_store_loaded_as_saved_serves_on_exactly_as_the_saved_one(model, saved):
    store, path = saved  # (served on below: the module's other tests read the file, not the store)
    loaded = PrefixStore.load(path, model, tuning_lag_requests=0)
    for tier in ("core", "offload"):
        assert tier_state(getattr(loaded, tier)) == tier_state(getattr(store, tier)), tier
    later = stream(5, 12)
    served, expected = serve(model, loaded, later), serve(model, store, later)
    assert [reused for _, reused in served] == [reused for _, reused in expected]
    assert sum(reused for _, reused in served) > 0  # (hits, from what was loaded)
    assert all(torch.equal(out, generate(model, prompt)[0]) for (out, _), prompt in zip(served, later, strict=True))
    loaded.flush(), store.flush()
    for tier in ("core", "offload"):
        assert tier_state(getattr(loaded, tier)) == tier_state(getattr(store, tier)), tier
    loaded.close()


def rewritten(path, edit) -> tuple:
    """(tensors, header) of the file at `path`, the header edited by `edit`."""
    tensors = load_file(path)
    header = json.loads(safetensors_header(path)[1]["__metadata__"]["prefixlab"])
    edit(header)
    return tensors, header


def test_a_file_without_policy_states_loads_as_before(model, saved, tmp_path):
    store, path = saved
    tensors, header = rewritten(path, lambda h: h.pop("policy_state"))
    old = tmp_path / "old.safetensors"
    write_store_file(old, tensors, header)
    loaded = PrefixStore.load(old, model, tuning_lag_requests=0)
    assert loaded.core.alpha == store.core.alpha and loaded.core.admission.law.seen == 0  # re-admitted, law fresh
    assert loaded.stats()["used_bytes"] > 0
    prompts = stream(6, 3)
    assert all(torch.equal(out, generate(model, prompt)[0])
               for (out, _), prompt in zip(serve(model, loaded, prompts), prompts, strict=True))
    loaded.close()


def test_a_store_loaded_with_another_budget_re_admits(model, saved):
    loaded = PrefixStore.load(saved[1], model, tuning_lag_requests=0, capacity=70_000)
    as_saved = PrefixStore.load(saved[1], model, tuning_lag_requests=0)
    assert loaded.core.admission.law.seen == 0 and loaded.core.bootstrap is not None  # device: as before
    assert as_saved.core.admission.law.seen > 0
    assert tier_state(loaded.offload) == tier_state(as_saved.offload)  # the host tier was loaded as saved
    loaded.close(), as_saved.close()


def test_a_namespace_one_tier_lacks_loads_node_for_node(model, tmp_path):
    """The device tier evicted every "default" entry to the host tier: the load's count of the entries it dropped
    walked the device tier in that namespace, and each walk of a namespace without a root takes a node id (the ids
    of every node added after the load were 2 above the saved store's)."""
    store = PrefixStore(model, **OPTIONS)
    for i, prompt in enumerate(stream(4, 30)):
        generate(model, prompt, store, ("default", "tenant-a")[i % 2])
    store.flush()
    assert "default" not in store.core.tree.roots and "default" in store.offload.tree.roots
    path = tmp_path / "store.safetensors"
    store.save(path)
    loaded = PrefixStore.load(path, model, tuning_lag_requests=0)
    for tier in ("core", "offload"):
        saved_tree, loaded_tree = getattr(store, tier).tree, getattr(loaded, tier).tree
        assert tier_state(getattr(loaded, tier)) == tier_state(getattr(store, tier)), tier
        assert loaded_tree._next_id == saved_tree._next_id, tier
    store.close(), loaded.close()


def test_a_store_saved_over_its_budget_loads_without_overflow(model, tmp_path):
    """overflow=True kept a store over its budget; loaded without it (the option is not saved) the device tier is
    re-admitted to fit, as with another budget (it was refused as a corrupt file); with it, rebuilt as saved."""
    store = PrefixStore(model, **(OPTIONS | {"capacity": 20_000, "offload_capacity": None}), overflow=True)
    serve(model, store, stream(4, 12))
    store.flush()
    assert store.stats()["used_bytes"] > store.capacity_bytes and store.core.bootstrap is None
    path = tmp_path / "store.safetensors"
    store.save(path)
    with pytest.warns(RuntimeWarning, match="refused or evicted while loading"):
        fitted = PrefixStore.load(path, model, tuning_lag_requests=0)
    assert 0 < fitted.stats()["used_bytes"] <= fitted.capacity_bytes and fitted.core.admission.law.seen == 0
    as_saved = PrefixStore.load(path, model, tuning_lag_requests=0, overflow=True)
    assert tier_state(as_saved.core) == tier_state(store.core)
    store.close(), fitted.close(), as_saved.close()


def device(header) -> dict:
    return header["policy_state"]["device"]


DAMAGES = {
    "not an object": lambda h: h.update(policy_state=[]),
    "a tier not saved": lambda h: h["policy_state"].update(elsewhere=None),
    "version": lambda h: device(h).update(version=0),
    "clock": lambda h: device(h).update(clock=-5),
    "a node missing": lambda h: device(h)["nodes"].pop(),
    "a last access after the clock": lambda h: device(h)["nodes"][0].__setitem__(0, device(h)["clock"] + 1),
    "leaf weight": lambda h: device(h).update(leaf_weight=0.0),
    "a negative law count": lambda h: device(h)["admission"]["law"]["totals"].__setitem__(0, -1.0),
    "a law histogram of another size": lambda h: device(h)["admission"]["laws"]["extend"]["histogram"].__setitem__(
        0, 3),
    "a kind of a node not saved": lambda h: device(h)["admission"]["kinds"].append([10**6, "extend"]),
    "no admission state for dp": lambda h: device(h).update(admission=None),
    "a root id of a node": lambda h: device(h)["roots"][0].__setitem__(1, h["tiers"]["device"][0]["id"]),
    "a node before its parent": lambda h: child_first(h["tiers"]["device"]),
}


def child_first(nodes: list) -> None:
    """Move the first node with a parent to the front (before its parent: a rebuild finds no parent for it)."""
    at = next(i for i, node in enumerate(nodes) if node["parent"] is not None)
    nodes.insert(0, nodes.pop(at))


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("capacity", [None, 70_000])
def test_a_damaged_policy_state_is_refused_whatever_the_load_options(model, saved, tmp_path, damage, capacity):
    tensors, header = rewritten(saved[1], DAMAGES[damage])
    if capacity is not None and damage in ("a root id of a node", "a node before its parent"):
        pytest.skip("checked where the tier is rebuilt (re-admitted, the same file loads as before)")
    copied = tmp_path / "store.safetensors"
    if capacity is None:
        assert_refused_untouched(model, copied, tensors, header)
        return
    write_store_file(copied, tensors, header)
    with pytest.raises(CorruptStoreError, match=copied.name):
        PrefixStore.load(copied, model, capacity=capacity)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "llama", "mamba2"])
def test_a_store_loaded_as_saved_computes_what_the_model_alone_does(family, tmp_path):
    """GatedDeltaNet, Mamba2 hybrids, a KV-only tree (single-child nodes merged) and a recurrent-only model: the
    rebuilt store reuses as the saved one and its outputs are the model's own (greedy tokens, fp32 scores)."""
    model = build(family)
    store = PrefixStore(model, **(OPTIONS | {"offload_capacity": None}))
    prompts = stream(4, 24)
    for prompt in prompts:
        scored(model, prompt, store)
    store.flush()
    assert store.core.bootstrap is None and store.core.evictions > 0
    path = tmp_path / "store.safetensors"
    store.save(path)
    loaded = PrefixStore.load(path, model, tuning_lag_requests=0)
    assert tier_state(loaded.core) == tier_state(store.core)
    again = [torch.cat([prompt, prompt[:, :3]], 1) for prompt in prompts[-8:]]  # (held prefixes: hits)
    served = [scored(model, prompt, loaded) for prompt in again]
    assert [reused for *_, reused in served] == [scored(model, prompt, store)[2] for prompt in again]
    assert sum(reused for *_, reused in served) > 0
    for (tokens, scores, _), prompt in zip(served, again, strict=True):
        alone, alone_scores, _ = scored(model, prompt)
        assert torch.equal(tokens, alone)
        assert max((a - b).abs().max().item() for a, b in zip(scores, alone_scores, strict=True)) <= 1e-5
    store.close(), loaded.close()


def scored(model, prompt, store=None) -> tuple:
    """(greedy tokens, per-step fp32 scores, reused tokens) of a generate() through `store`, or the model alone."""
    cache = {} if store is None else {cache_argument(model): HybridPrefixCache(store)}
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True, **cache)
    return out.sequences, out.scores, next(iter(cache.values())).reused_tokens if cache else 0
