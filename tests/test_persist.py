"""PrefixStore.save / PrefixStore.load (cache/persist.py): exact round trips of both tiers and the weights
fingerprint (damaged files and failed saves and loads: test_persist_damage.py)."""

import persist_helpers
import pytest
import torch
from hf_models import build
from persist_helpers import FAMILY, NAMESPACES, PROMPTS, contents, generate, model_state

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache import persist
from prefixlab.errors import ModelMismatchError

saved = persist_helpers.saved  # (the fixture, by name)


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


def marks(core) -> dict:
    """{(namespace, path tokens): (branched, truncated, resumed)} of the nodes marked for strict budgets."""
    found = {}
    for node in core.tree.nodes():
        if not node.is_root and (node.branched, node.truncated, node.resumed) != (False, False, 0):
            path = [n for n in reversed(node.ancestors()) if not n.is_root]
            found[(node.namespace, tuple(t for n in path for t in n.tokens.tolist()))] = (
                node.branched, node.truncated, node.resumed)
    return found


def test_the_marks_strict_budgets_read_survive_a_round_trip(tmp_path):
    """A branch point requests resumed from and a leaf cut short (cache/strict.py): a loaded store protected no
    branch point until two requests resumed from it again."""
    model = build(FAMILY)
    store = PrefixStore(model, capacity="64MB", policy="dp")
    system = PROMPTS[0][:, :16]
    for seed in range(4):  # questions branching off one system prompt, each resuming from its branch point
        generate(model, torch.cat([system, PROMPTS[1][:, seed:seed + 6]], 1), store)
    store.flush()
    leaf = next(node for node in store.core.tree.nodes() if not node.is_root and not node.children)
    leaf.truncated = True
    before = marks(store.core)
    assert any(resumed >= 2 for _, _, resumed in before.values()) and any(t for _, t, _ in before.values())
    store.save(tmp_path / "store.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "store.safetensors", model)
    assert marks(loaded.core) == before
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
