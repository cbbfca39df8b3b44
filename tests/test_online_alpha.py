"""dp's online alpha (prefixlab/cache/online_alpha.py): no replays, and regretted evictions move alpha."""

from __future__ import annotations

import numpy as np
from prefix_helpers import request, tiny_spec
from test_replay import _conversations

from prefixlab.cache.core import PrefixCacheCore
from prefixlab.cache.online_alpha import Ghosts, RegretThinning
from prefixlab.sim.replay import simulate

LONG = np.arange(100, 164)  # one long entry (its state saves the most FLOPs per byte)
SHORT = [np.arange(1000 * i, 1000 * i + 8) for i in (1, 2, 3)]  # short entries, newer


def _filled(alpha: float) -> PrefixCacheCore:
    core = PrefixCacheCore(10**7, "dp", tiny_spec(), block_size=4)
    assert isinstance(core.eviction, RegretThinning) and core.bootstrap is None  # nothing to replay
    for tokens in (LONG, *SHORT):
        request(core, tokens)
    for node in list(core.tree.nodes()):  # keep only the entries' end states: evictions take whole entries
        interior = sum(p < node.end for p in node.ckpt_pos)
        if interior:
            core.tree.drop_checkpoints(node, 0, interior)
    core.eviction.alpha = alpha
    core.capacity_bytes = core.used_bytes  # the next byte evicts one entry (as an admission would: a tick later)
    core.clock += 1
    assert core._make_room(1, core.tree.root("default"))
    return core


def test_dp_never_replays_to_tune_alpha():
    requests, spec = _conversations(12, 5), tiny_spec()
    dp = simulate(requests, "dp", 700, spec)
    assert dp.evictions and dp.tuning_seconds == 0.0 and dp.alpha is not None


def test_a_regretted_eviction_moves_alpha_toward_the_expert_that_would_have_kept_it():
    # recency (alpha 0) evicts the old, efficient entry; resuming short of it again moves alpha up
    core = _filled(0.0)
    assert core.tree.walk(LONG, "default").shared_length == 0 and len(core.eviction.ghosts) == 1
    request(core, LONG)
    assert core.eviction.regrets == 1 and core.eviction.alpha > 0.0
    # efficiency (alpha 2) evicts a newer, inefficient one; its regret moves alpha down
    core = _filled(2.0)
    (gone,) = [t for t in SHORT if core.tree.walk(t, "default").shared_length == 0]
    request(core, gone)
    assert core.eviction.regrets == 1 and core.eviction.alpha < 2.0
    # a request sharing no evicted prefix regrets nothing
    core = _filled(0.0)
    request(core, np.arange(5000, 5064))
    assert core.eviction.regrets == 0 and core.eviction.alpha == 0.0


def test_ghosts_match_exact_prefixes_and_stay_bounded():
    ghosts = Ghosts(max_ghosts=2)
    path = [np.arange(10), np.arange(10, 20)]
    ghosts.add("default", path, 15, (0.0, 1.0))
    other = np.concatenate([np.arange(10) + 1, np.arange(10, 20)])  # same depth and last token, other prefix
    assert ghosts.deepest("default", other, 0, 20) is None
    assert ghosts.deepest("chat", np.arange(20), 0, 20) is None  # another namespace
    assert ghosts.deepest("default", np.arange(20), 15, 20) is None  # resumed at the ghost's depth already
    assert ghosts.deepest("default", np.arange(20), 3, 20) == (15, (0.0, 1.0))
    assert len(ghosts) == 0  # found once
    for depth in (5, 6, 7):
        ghosts.add("default", path, depth, (0.5, 0.5))
    assert len(ghosts) == 2 and ghosts.deepest("default", np.arange(20), 0, 5) is None  # the oldest forgotten
