"""Model-based test of PrefixCacheCore against a brute-force reference (hypothesis stateful).

Random streams of match / plan / admit / release over a 3-token alphabet (prompts glued from a few shared chunks, so
prefixes collide), in several namespaces, with held locks, interleaved requests, direct admissions (what load and the
offload tier do), simulator replays, tight and loose budgets, `fork()` and a re-admission round trip (what
save/load does). After every step the tree is enumerated by plain recursion (no walk) and checked against:
- the reference: everything ever offered, as a plain list of (namespace, tokens, state positions); nothing else may
  appear, and what was admitted stays until an eviction happens;
- each match: length = the deepest held checkpoint on the prompt (every shared token for a KV-only model),
  shared_length = the longest common prefix with a held path, in that namespace only;
- payloads: KV and states carry their namespace and tokens, so a reuse of another namespace's or prefix's entry
  shows;
- bytes recomputed from the tree and the spec, used <= capacity, locked matches' entries still held, and
  check_invariants().

`PREFIXLAB_SOAK=N` multiplies the number of examples by N with random seeds. The default run is derandomized: the
same streams every run of the same test selection (hypothesis also draws constants from the modules imported).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from core_reference import BLOCK, KV, KV_BYTES_PER_TOKEN, STATE_BYTES, State, content, spec, superseded, trie_size
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.payload import SizedKV, SizedState
from prefixlab.cache.policies import POLICY_NAMES
from prefixlab.cache.replay import replay_request

NAMESPACES = ("default", "a", "b")
# tight (a few short entries) ... loose (never evicts)
CAPACITIES = (130, 300, 700, 1500, 4000, 1 << 40)
SOAK = int(os.environ.get("PREFIXLAB_SOAK", "1"))
OPERATIONS = {"count": 0}


class CoreMachine(RuleBasedStateMachine):
    """Subclassed per (policy, hybrid, payload kind) by `machine()`."""

    policy, hybrid, sized = "marconi", True, False

    @initialize(
        capacity=st.sampled_from(CAPACITIES),
        chunks=st.lists(st.tuples(st.sampled_from([1, 2, 5, 12, 33, 70]), st.integers(0, 1 << 32)).map(
            lambda c: np.random.default_rng(c[1]).integers(0, 3, c[0], dtype=np.uint8).tobytes()),
            min_size=5, max_size=5),
    )
    def setup(self, capacity, chunks):
        self.capacity, self.chunks = capacity, chunks
        self.core = self._new_core()
        self.offered: set[tuple[str, bytes]] = set()  # every (namespace, prefix) a state was offered for
        self.reference: list[tuple[str, bytes, frozenset[int]]] = []  # every entry offered (sequence, states)
        self.held: list[tuple] = []  # (match, namespace, prompt, whether its state may be gone) of live matches
        self.pending: list[tuple] = []  # (match, namespace, tokens, planned positions): requests in flight
        self.may_vanish: set[tuple[str, bytes]] = set()  # what the last step may have dropped without evicting
        self.before = content(self.core, self.sized)
        self.evictions = self.core.evictions

    def _new_core(self) -> PrefixCacheCore:
        return PrefixCacheCore(self.capacity, self.policy, spec(self.hybrid), block_size=BLOCK, bootstrap_multiplier=2)

    # drawing sequences ---------------------------------------------------------------------------------------------
    def _tokens(self, picks: list[int], tail: bytes) -> bytes:
        return b"".join(self.chunks[i] for i in picks) + bytes(x % 3 for x in tail)

    def _continuation(self, which: int, tail: bytes) -> tuple[str, bytes]:
        """A follow-up turn: an earlier sequence (reference) plus new tokens."""
        namespace, tokens, _ = self.reference[which % len(self.reference)]
        return namespace, tokens + bytes(x % 3 for x in tail)

    def _payloads(self, namespace: str, tokens: bytes, positions) -> tuple:
        if self.sized:
            return (lambda a, b: SizedKV(b - a, KV_BYTES_PER_TOKEN)), {p: SizedState(STATE_BYTES) for p in positions}
        return (lambda a, b: KV(namespace, tokens[a:b])), {p: State(namespace, tokens[:p]) for p in positions}

    # checked operations --------------------------------------------------------------------------------------------
    def _match(self, namespace: str, prompt: bytes):
        OPERATIONS["count"] += 1
        now = content(self.core, self.sized)
        match = self.core.match(np.frombuffer(prompt, dtype=np.uint8), namespace)
        expected = (now.reusable(namespace, prompt, self.hybrid), now.shared(namespace, prompt))
        assert (match.length, match.shared_length) == expected, f"match {prompt!r} in {namespace!r}"
        assert (match.state is None) == (not self.hybrid or match.length == 0)
        assert sum(kv.ntokens for kv in match.kv) == match.length
        if not self.sized:  # the exact KV and state of the reused tokens, of this namespace
            assert b"".join(kv.tokens for kv in match.kv) == prompt[: match.length]
            assert {kv.namespace for kv in match.kv} <= {namespace}
            assert match.state is None or match.state == State(namespace, prompt[: match.length])
        return match

    def _plan(self, match, tokens: bytes) -> list[int]:
        positions = self.core.plan(np.frombuffer(tokens, dtype=np.uint8), match)
        assert positions == sorted(set(positions)) and all(match.length < p <= len(tokens) for p in positions)
        assert self.hybrid or not positions
        return positions

    def _admit(self, namespace: str, tokens: bytes, positions, match=None) -> None:
        """Admit with exact payloads and check what appears: all of it if it fits, else a prefix of it or its end."""
        OPERATIONS["count"] += 1
        before, used, evictions = content(self.core, self.sized), self.core.used_bytes, self.core.evictions
        positions = sorted(set(positions))
        self.reference.append((namespace, tokens, frozenset(positions)))
        self.offered.update((namespace, tokens[:p]) for p in positions)
        kv, states = self._payloads(namespace, tokens, positions)
        admitted = self.core.admit(np.frombuffer(tokens, dtype=np.uint8), kv, states, match, namespace)
        after = content(self.core, self.sized)

        shared = before.shared(namespace, tokens)
        keep_end = (positions[-1] if positions else 0) if self.hybrid else len(tokens)
        new = [p for p in positions if (namespace, tokens[:p]) not in before.checkpoints] if self.hybrid else []
        entry_bytes = max(0, keep_end - shared) * KV_BYTES_PER_TOKEN + len(new) * STATE_BYTES
        dropped = superseded(self.policy, namespace, tokens, after)
        present = [p for p in new if (namespace, tokens[:p]) in after.checkpoints]
        missing = [p for p in new if p not in present and (namespace, tokens[:p]) not in dropped]
        # a prefix of it (a cut), or, for a sequence's next stage under a strict budget, its end without some of
        # its inner states (cache/strict.py)
        end_kept = bool(present) and present[-1] == new[-1] and after.holds_path(namespace, tokens[:keep_end])
        assert end_kept or all(p > max(present, default=0) for p in missing), f"stored {present} of {new}"
        stored_any = present or after.shared(namespace, tokens) > shared
        assert admitted or not stored_any, "admit returned False but stored part of the entry"
        if admitted and entry_bytes:  # at least the first part of what it lacked (or it superseded what it stored)
            assert stored_any or len(missing) < len(new), "admit returned True but stored nothing"
        if entry_bytes <= self.capacity - used:  # it fits without evicting: all of it is there
            assert not missing, f"an entry of {entry_bytes} bytes fitting in {self.capacity - used} was cut"
            assert after.holds_path(namespace, tokens[:keep_end]) and self.core.evictions == evictions
        self.may_vanish = dropped

    def _release(self, match) -> None:
        OPERATIONS["count"] += 1
        self.core.release(match)

    # rules ---------------------------------------------------------------------------------------------------------
    prompts = st.tuples(st.lists(st.integers(0, 4), max_size=4), st.binary(max_size=6))

    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts, output=st.binary(max_size=8), hold=st.booleans())
    def request(self, namespace, prompt, output, hold):
        """match -> plan -> admit (prompt + output) -> release, the whole request at once."""
        self._request(namespace, self._tokens(*prompt), bytes(x % 3 for x in output), hold)

    @precondition(lambda self: self.reference)
    @rule(which=st.integers(0, 1 << 16), question=st.binary(min_size=1, max_size=10), output=st.binary(max_size=8))
    def next_turn(self, which, question, output):
        """The next turn of an earlier conversation: its whole sequence plus a new question."""
        namespace, prompt = self._continuation(which, question)
        self._request(namespace, prompt, bytes(x % 3 for x in output), False)

    def _request(self, namespace: str, prompt: bytes, output: bytes, hold: bool) -> None:
        if not prompt:
            return
        match = self._match(namespace, prompt)
        tokens = prompt + output
        self._admit(namespace, tokens, self._plan(match, tokens), match)
        if hold:  # vllm+: the request's own extension may supersede the partial-block state it reused
            state = (namespace, prompt[: match.length])
            gone = state in self.may_vanish and state not in content(self.core, self.sized).checkpoints
            self.held.append((match, namespace, prompt, gone))
        else:
            self._release(match)

    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts, output=st.binary(max_size=8))
    def start(self, namespace, prompt, output):
        """A request that matched and planned; its admission comes later, after other requests."""
        prompt = self._tokens(*prompt)
        if prompt:
            match = self._match(namespace, prompt)
            tokens = prompt + bytes(x % 3 for x in output)
            self.pending.append((match, namespace, tokens, self._plan(match, tokens)))

    @precondition(lambda self: self.pending)
    @rule(which=st.integers(0, 1 << 16), admit=st.booleans())
    def finish(self, which, admit):
        """Admit a request in flight (or drop it: its forward raised) and release its match."""
        match, namespace, tokens, positions = self.pending.pop(which % len(self.pending))
        if admit:
            self._admit(namespace, tokens, positions, match)
        self._release(match)

    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts)
    def lock(self, namespace, prompt):
        """Hold a match (a request being served) while the stream goes on."""
        prompt = self._tokens(*prompt)
        self.held.append((self._match(namespace, prompt), namespace, prompt, False))

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 1 << 16))
    def unlock(self, which):
        self._release(self.held.pop(which % len(self.held))[0])

    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts, cuts=st.lists(st.integers(1, 1 << 16), max_size=3))
    def admit_without_match(self, namespace, prompt, cuts):
        """A path and its states offered directly (what load and the offload tier do)."""
        tokens = self._tokens(*prompt)
        if tokens:
            positions = [len(tokens)] + [1 + c % len(tokens) for c in cuts]  # a KV-only model must ignore them
            self._admit(namespace, tokens, positions)

    @precondition(lambda self: self.sized)
    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts, output=st.binary(max_size=8))
    def replay(self, namespace, prompt, output):
        """The simulator's request (size-only payloads, the walk resumed from the match's)."""
        prompt, output = self._tokens(*prompt), bytes(x % 3 for x in output)
        OPERATIONS["count"] += 1
        now = content(self.core, self.sized)
        expected = now.reusable(namespace, prompt, self.hybrid)
        tokens = prompt + output
        hit = replay_request(self.core, np.frombuffer(prompt, dtype=np.uint8), np.frombuffer(output, dtype=np.uint8),
                             namespace)
        assert hit == expected
        # the states it offered are the policy's plan: record them as offered (the reference's superset)
        self.reference.append((namespace, tokens, frozenset(range(1, len(tokens) + 1))))
        self.offered.update((namespace, tokens[:p]) for p in range(1, len(tokens) + 1))
        self.may_vanish = superseded(self.policy, namespace, tokens, content(self.core, self.sized))

    @precondition(lambda self: not self.held and not self.pending)
    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts, keep_twin=st.booleans())
    def fork(self, namespace, prompt, keep_twin):
        """fork() copies everything observable, and the copies are independent afterwards."""
        OPERATIONS["count"] += 1
        twin = self.core.fork()
        original = content(self.core, self.sized)
        assert content(twin, self.sized) == original and twin.stats() == self.core.stats()
        twin.check_invariants()
        keep, self.core = self.core, twin
        self._request(namespace, self._tokens(*prompt) or b"\0", b"\1", False)  # a request on the twin only
        assert content(keep, self.sized) == original, "a request on a fork changed the original"
        keep.check_invariants()
        self.core = self.core if keep_twin else keep

    @precondition(lambda self: not self.held and not self.pending)
    @rule()
    def readmit_everything(self):
        """The save/load analogue: a fresh core of the same budget and policy re-admits every held path with its
        checkpoints (`restore=True`, as PrefixStore.load does) and holds the same entries in the same bytes."""
        OPERATIONS["count"] += 1
        held = content(self.core, self.sized)
        fresh = self._new_core()
        for namespace, leaves in held.leaves.items():
            for leaf in leaves:
                positions = [len(p) for ns, p in held.checkpoints if ns == namespace and leaf.startswith(p)]
                kv, states = self._payloads(namespace, leaf, positions)
                assert fresh.admit(np.frombuffer(leaf, dtype=np.uint8), kv, states, namespace=namespace, restore=True)
        restored = content(fresh, self.sized)
        assert restored.checkpoints == held.checkpoints, "re-admitting every path lost or added states"
        if self.hybrid:  # KV after a leaf's last checkpoint is not re-admitted (it is never reusable)
            assert restored.kv_tokens == trie_size(restored.checkpoints) <= held.kv_tokens
        else:
            assert restored == held, "re-admitting every path lost or changed entries"
        assert fresh.used_bytes == restored.kv_tokens * KV_BYTES_PER_TOKEN + len(restored.checkpoints) * STATE_BYTES
        fresh.check_invariants()
        self.core = fresh
        self.evictions = fresh.evictions

    # checks after every step ----------------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        core, now = self.core, content(self.core, self.sized)
        core.check_invariants()
        assert core.used_bytes <= core.capacity_bytes
        # exact bytes, recomputed from the tree and the spec
        assert core.tree.kv_bytes == now.kv_tokens * KV_BYTES_PER_TOKEN
        assert core.tree.state_bytes == len(now.checkpoints) * STATE_BYTES == core.tree.num_checkpoints * STATE_BYTES
        assert self.hybrid or not now.checkpoints, "a KV-only model holds states"
        # nothing that was never offered (in that namespace) appears
        assert now.checkpoints <= self.offered, f"never offered: {now.checkpoints - self.offered}"
        for namespace, leaves in now.leaves.items():
            for leaf in leaves:
                assert any(ns == namespace and tokens.startswith(leaf) for ns, tokens, _ in self.reference), (
                    f"{leaf!r} held in {namespace!r} but never admitted there")
        # locked entries stay: every live match's state and KV are still held
        for match, namespace, prompt, gone in self.held + [(m, ns, t, False) for m, ns, t, _ in self.pending]:
            assert now.holds_path(namespace, prompt[: match.length]), "a locked match's KV was evicted"
            assert not self.hybrid or not match.length or gone or (
                (namespace, prompt[: match.length]) in now.checkpoints), "a locked match's state was evicted"
        # without an eviction nothing disappears (bar what the step's admission superseded)
        if core.evictions == self.evictions:
            lost = self.before.checkpoints - now.checkpoints - self.may_vanish
            assert not lost, f"checkpoints vanished without an eviction: {lost}"
            if not self.hybrid:
                for namespace, leaves in self.before.leaves.items():
                    assert all(now.holds_path(namespace, leaf) for leaf in leaves), "KV vanished without an eviction"
        self.before, self.evictions, self.may_vanish = now, core.evictions, set()

    def teardown(self):
        if not hasattr(self, "core"):
            return
        for match, *_ in self.held + self.pending:
            self.core.release(match)
        self.core.check_invariants()
        assert self.core.stats()["locked_matches"] == 0
        assert all(node.lock_count == 0 for node in self.core.tree.nodes())


def machine(policy: str, hybrid: bool, sized: bool) -> type[CoreMachine]:
    return type(f"Core_{policy}_{hybrid}_{sized}", (CoreMachine,), {"policy": policy, "hybrid": hybrid, "sized": sized})


CASES = [(policy, hybrid) for policy in POLICY_NAMES for hybrid in (True, False)]


@pytest.mark.parametrize(("policy", "hybrid"), CASES, ids=[f"{p}-{'hybrid' if h else 'kv'}" for p, h in CASES])
@pytest.mark.parametrize("sized", [False, True], ids=["token-payloads", "sized-payloads"])
def test_core_matches_the_reference(policy, hybrid, sized):
    run_state_machine_as_test(machine(policy, hybrid, sized), settings=settings(
        max_examples=16 * SOAK, stateful_step_count=40, derandomize=SOAK == 1, deadline=None,
        suppress_health_check=list(HealthCheck), print_blob=True,
    ))


def test_the_model_runs_enough_operations():
    """The cases above ran >= 10k checked operations (when run together, as in CI)."""
    if OPERATIONS["count"] == 0:
        pytest.skip("run with the model tests to count their operations")
    assert OPERATIONS["count"] >= 10_000, f"only {OPERATIONS['count']} operations"
