"""Strict byte budgets (cache/strict.py): what an entry its own locked path leaves no room for may thin, and what
it must keep."""

import pytest
from prefix_helpers import KV_BYTES_PER_TOKEN, STATE_BYTES, PrefixState, TokenKV, naive_match, request, tiny_spec

from prefixlab.cache.core import PrefixCacheCore


def _core(capacity_bytes, policy, block_size=4):
    return PrefixCacheCore(capacity_bytes, policy, tiny_spec(), block_size=block_size)


@pytest.mark.parametrize("policy", ["dp", "marconi", "sglang+", "vllm+", "marconi+block"])
def test_one_conversation_that_fills_a_strict_budget_keeps_resuming_its_last_turn(policy):
    """Its path is locked while each turn is admitted, so nothing else could be evicted: its own shallower states
    are dropped for the new turn's (they were kept and every later turn refused, reusing turn 3 for good)."""
    core = _core(3 * STATE_BYTES + 150 * KV_BYTES_PER_TOKEN, policy)
    tokens, block_cut = list(range(1, 11)), 4 if policy == "vllm+" else 0  # (vllm+ may cut an entry at a block)
    for turn in range(12):
        match = request(core, tokens, [500 + turn], release=False)
        last_turn_end = len(tokens) - 9 if turn else 0  # its output included
        assert last_turn_end - block_cut <= match.length <= last_turn_end, f"turn {turn}"
        core.release(match)
        assert core.used_bytes <= core.capacity_bytes and core.rejected == 0
        core.check_invariants()
        tokens = [*tokens, 500 + turn, *range(100 + 10 * turn, 109 + 10 * turn)]


@pytest.mark.parametrize("policy", ["dp", "marconi"])
def test_the_state_an_entry_extends_and_live_requests_resume_from_are_not_dropped_for_it(policy):
    core = _core(2 * STATE_BYTES + 30 * KV_BYTES_PER_TOKEN, policy)
    system = list(range(1, 11))
    request(core, system)
    live = request(core, system, release=False)  # another request resuming from the same state
    assert live.length == len(system)
    question = [*system, *range(100, 125)]  # a long question: only dropping the system prompt's state would fit it
    request(core, question)
    assert core.match(system).length == len(system) and core.rejected == 1
    core.release(live)
    core.check_invariants()


@pytest.mark.parametrize("policy", ["marconi", "sglang+", "dp"])
def test_a_question_branching_off_a_document_does_not_thin_the_document_for_itself(policy):
    """Questions on one document diverge a token or two past it; the states at those branch points stay when a
    longer question does not fit (dropping them would make the next question recompute the whole document: the
    QuALITY trace at 0.5 GB fell from 98 to 83 % when they were thinned like a conversation's past turns)."""
    core = _core(3 * STATE_BYTES + 60 * KV_BYTES_PER_TOKEN, policy)
    document = list(range(1, 51))
    for question in ([7, *range(300, 310)], [7, 9, *range(320, 330)], [7, 8, *range(310, 320)],
                     [7, 8, 5, *range(330, 340)], [7, 8, 6, *range(400, 430)]):
        request(core, [*document, *question])
        assert core.used_bytes <= core.capacity_bytes
        core.check_invariants()
    assert naive_match(core, [*document, 7, 99])[0] == len(document) + 1  # the branch point after the document


@pytest.mark.parametrize("policy", ["dp", "marconi", "sglang+", "vllm+", "marconi+block"])
def test_a_turn_whose_entry_alone_fits_a_budget_of_one_state_is_stored_in_place_of_the_last(policy):
    """The state a turn extends went last of all but never went: from turn 6 every turn reused turn 5 for good."""
    core = _core(STATE_BYTES + STATE_BYTES // 2 + 80 * KV_BYTES_PER_TOKEN, policy)
    sequence = []
    for turn in range(8):
        tokens = [*sequence, *range(1000 + 20 * turn, 1010 + 20 * turn), 2000 + turn, 2100 + turn]
        match = core.match(tokens[:-3])  # (the HF path: all but the prompt's last token; no live match at admit)
        assert match.length == len(sequence), f"turn {turn}"
        plan = core.plan(tokens, match)
        core.release(match)
        core.admit(tokens, lambda a, b, t=tokens: TokenKV(tuple(t[a:b])),
                   {p: PrefixState(tuple(tokens[:p])) for p in {*plan, len(tokens)}})
        assert [n for n in core.tree.nodes() if not n.is_root and not n.ckpt_pos and len(n.children) == 1] == []
        core.check_invariants()
        sequence = tokens


@pytest.mark.parametrize("policy", ["marconi", "sglang+", "vllm+"])
def test_an_entry_no_store_could_hold_is_refused_before_anything_is_evicted_for_it(policy):
    core = _core(3 * STATE_BYTES, policy, block_size=64)
    request(core, [1, 2, 3, 4, 5])
    before = (core.used_bytes, core.stats()["nodes"], core.evictions)
    request(core, list(range(100, 300)))  # 800 bytes of KV before its first state: more than the whole budget
    assert (core.used_bytes, core.stats()["nodes"], core.evictions) == before and core.rejected == 1
    assert core.match([1, 2, 3, 4, 5, 6]).length == 5


@pytest.mark.parametrize("policy", ["dp", "marconi", "sglang+", "vllm+"])
def test_a_conversation_whose_history_is_re_rendered_keeps_resuming_its_last_turn(policy):
    """Each prompt re-renders the previous answer's last token (a template stripping a turn's thinking): every turn
    branches off the last one, and those branch points, resumed only by the next turn, were kept for good (review of
    session 39: dp stuck at 33 tokens, 10 turns refused)."""
    core = _core(3 * STATE_BYTES + 150 * KV_BYTES_PER_TOKEN, policy)
    prompt, reused = list(range(1, 11)), []
    for turn in range(14):
        answer = [500 + turn, 600 + turn]
        reused.append(request(core, prompt, answer).length)
        core.check_invariants()
        prompt = [*prompt, answer[0], 700 + turn, *range(100 + 10 * turn, 109 + 10 * turn)]
    assert core.rejected == 0 and reused[-1] > reused[-2] > reused[-3] > 100
