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
                   namespace: str = "default") -> int:
    """One simulated request with size-only payloads: match the input, admit input + output with the states the
    policy plans (the simulator's and the alpha tuner's step, as in Marconi's replay). Returns the hit length."""
    input_tokens, output_tokens = as_tokens(input_tokens, "input_tokens"), as_tokens(output_tokens, "output_tokens")
    tokens = np.concatenate([input_tokens, output_tokens]) if len(output_tokens) else input_tokens
    return replay_tokens(core, tokens, len(input_tokens), check_namespace(namespace))


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
