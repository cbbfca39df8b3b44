"""One simulated request through a PrefixCacheCore with size-only payloads: the simulator's and the alpha tuner's
step (Marconi's replay)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prefixlab.cache.payload import SizedKV, SizedState
from prefixlab.cache.tokens import as_tokens, check_namespace

if TYPE_CHECKING:
    from prefixlab.cache.core import PrefixCacheCore


def replay_request(core: PrefixCacheCore, input_tokens: np.ndarray, output_tokens: np.ndarray,
                   namespace: str = "default", *, as_store: bool = False) -> int:
    """One simulated request with size-only payloads: match the input, admit input + output with the states the
    policy plans (the simulator's and the alpha tuner's step, as in Marconi's replay). Returns the hit length.
    `as_store=True`: the calls a PrefixStore makes for the request instead (replay_as_store)."""
    input_tokens, output_tokens = as_tokens(input_tokens, "input_tokens"), as_tokens(output_tokens, "output_tokens")
    tokens = np.concatenate([input_tokens, output_tokens]) if len(output_tokens) else input_tokens
    replay = replay_as_store if as_store else replay_tokens
    return replay(core, tokens, len(input_tokens), check_namespace(namespace))


def replay_as_store(core: PrefixCacheCore, tokens: np.ndarray, input_length: int, namespace: str = "default") -> int:
    """replay_tokens as a PrefixStore serves the request (one row, a patched model whose decode steps compute as its
    prefill: HybridPrefixCache): it looks up all but the prompt's last token (it recomputes that one for its
    logits; prompts under 2 tokens reuse nothing), plans over the prompt alone (the output is not known yet), also
    captures the state before the last token (where a repeat of the prompt resumes: hf.py `_plan_repeat`), and
    admits the tokens it fed, which end before the last output token (never fed), with the state at their end. On
    a model with a reuse limit (DSA) the tokens past it also run, the state at the limit is kept and nothing past it
    is admitted (store.admit_limit).
    These extra states and the other plan change what the budget holds, hence later hits and evictions, by more
    than the one token per request the lookup alone costs."""
    spec = core.spec
    limit = len(tokens) if spec.reuse_limit is None else spec.reuse_limit  # (PrefixStore.admit_limit: DSA models)
    prompt, positions, reused = tokens[:input_length], set(), 0
    fed = len(tokens) - 1 if len(tokens) > input_length else input_length
    end = min(fed, limit)  # nothing past the limit is admitted
    probe = min(input_length - 1, limit)  # (HybridPrefixCache._tail: the last token, and any past the limit, run)
    if input_length >= 2:
        match = core.match(prompt[:probe], namespace)
        try:
            reused = match.length
            positions = set(core.plan(prompt, match))
            if core.hybrid and probe > reused:
                positions.add(probe)
        finally:
            core.release(match)
    if limit < input_length:  # where later requests resume (hf_resume)
        positions.add(limit)
    # the state at the end is taken only where the admitted tokens end at the last token fed
    state = SizedState(spec.state_bytes)
    states = {p: state for p in positions | ({fed} if end == fed else set()) if 0 < p <= end} if core.hybrid else {}
    core.admit(tokens[:end], lambda a, b: SizedKV(b - a, spec.kv_bytes_per_token), states, namespace=namespace)
    return reused


def replay_tokens(core: PrefixCacheCore, tokens: np.ndarray, input_length: int, namespace: str = "default") -> int:
    """replay_request of validated `tokens` (input followed by output), skipping the public entry checks."""
    spec = core.spec
    if spec.reuse_limit is not None:  # nothing past it is held or reused (PrefixStore.admit_limit)
        tokens, input_length = tokens[: spec.reuse_limit], min(input_length, spec.reuse_limit)
    match = core._match(tokens[:input_length], namespace, with_kv=False)
    walk = core.tree.walk(tokens, namespace, resume=match.walk)
    positions = core.admission.plan(walk, len(tokens), match.length, input_length) if core.hybrid else []
    state = SizedState(spec.state_bytes)
    core._admit(tokens, walk, lambda a, b: SizedKV(b - a, spec.kv_bytes_per_token), dict.fromkeys(positions, state),
                match)
    core._release(match)
    return match.length
