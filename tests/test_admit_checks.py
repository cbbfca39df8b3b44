"""Direct `PrefixStore.admit` of KV and states that are not the model's: tensors of other shapes, dtypes or devices
than the model's layers compute were stored silently, then served to later requests (a crash inside generate, or
other tokens than the model's). Each is refused with what to give instead, and leaves the store as it was."""

import pytest
import torch
from hf_models import FAMILIES, build, generate, tokens
from test_refusals_unchanged import refused

from prefixlab import HybridPrefixCache, PrefixStore
from prefixlab.cache.tensors import TensorKV, TensorState
from prefixlab.errors import InvalidInputError

PROMPT = tokens(1, 20, seed=0)


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


@pytest.fixture
def served(model):
    """(model, a store holding PROMPT's entries, PROMPT's KV and its state at 16 tokens, as the model computed them)."""
    store = PrefixStore(model, capacity="64MB", block_size=4)
    generate(model, PROMPT, HybridPrefixCache(store))
    match = store.match(PROMPT[0, :17].tolist())
    assert match.length == 16 and match.state is not None
    kv = match.kv[0]
    for piece in match.kv[1:]:
        kv = kv.concat(piece)
    state = match.state
    store.release(match)
    yield model, store, kv, state
    store.close()


def _kv_of(kv: TensorKV, fn) -> TensorKV:
    return kv.mapped(kv.ntokens, fn)


def _state_of(state: TensorState, conv=lambda t: t, recurrent=lambda t: t) -> TensorState:
    return TensorState({k: conv(t) for k, t in state.conv.items()},
                       {k: recurrent(t) for k, t in state.recurrent.items()})


BAD_KV = {
    "head_dim": lambda t: t[..., :-1].clone(),
    "kv_heads": lambda t: torch.cat([t, t]),
    "device": lambda t: t.to("meta"),
}
BAD_STATES = {
    "conv shape": dict(conv=lambda t: t[..., :-1].clone()),
    "recurrent shape": dict(recurrent=lambda t: t.reshape(-1)),
    "recurrent dtype": dict(recurrent=lambda t: t.double()),
    "conv int": dict(conv=lambda t: t.to(torch.int32)),
    "conv device": dict(conv=lambda t: t.to("meta")),
}


@pytest.mark.parametrize("bad", BAD_KV)
def test_kv_of_other_shapes_or_devices_is_refused(served, bad):
    model, store, kv, state = served
    other = (PROMPT[0, :16] + 1).tolist()  # (ids 4..: a sequence the store does not hold)
    refused(store, lambda: store.admit(other, lambda a, b: _kv_of(kv.split(a)[1].split(b - a)[0], BAD_KV[bad]),
                                       {16: state}), InvalidInputError, "model")


@pytest.mark.parametrize("bad", BAD_STATES)
def test_states_of_other_shapes_dtypes_or_devices_are_refused(served, bad):
    model, store, kv, state = served
    other = (PROMPT[0, :16] + 1).tolist()
    refused(store, lambda: store.admit(other, lambda a, b: kv.split(a)[1].split(b - a)[0],
                                       {16: _state_of(state, **BAD_STATES[bad])}), InvalidInputError, "model")


def test_the_models_own_kv_and_states_are_still_admitted(served):
    model, store, kv, state = served
    other = (PROMPT[0, :16] + 1).tolist()
    assert store.admit(other, lambda a, b: kv.split(a)[1].split(b - a)[0], {16: state})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_own_kv_and_states_are_admitted_into_a_new_store(family):
    """The config's shapes and dtypes, with nothing learned yet, take what each family's model computes (Qwen4-Exp's
    n-gram context is a state of token ids)."""
    model = build(family)
    store = PrefixStore(model, capacity="64MB", block_size=4)
    generate(model, PROMPT, HybridPrefixCache(store))
    match = store.match(PROMPT[0, :17].tolist())
    kv, state, length = match.kv[0], match.state, match.length
    for piece in match.kv[1:]:
        kv = kv.concat(piece)
    store.release(match)
    store.close()
    fresh = PrefixStore(model, capacity="64MB", block_size=4)
    assert fresh.admit((PROMPT[0, :length] + 1).tolist(), lambda a, b: kv.split(a)[1].split(b - a)[0],
                       {length: state} if state is not None else {})
    fresh.close()
