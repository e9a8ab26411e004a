"""``Policy.host_preempted``: the host (vLLM) dropped a request's KV on its own; every policy takes it back for recompute.

Driven by the policy tests' host (``tests/test_policy.py::drive``), which checks the ledger, each step's tokens and
that every request ends with exactly its length and no KV left. Pure Python: no vLLM.
"""

from __future__ import annotations

import random

import pytest

from serving.policy.registry import make_policy
from tests.test_policy import POLICIES, cfg, drive, req

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_recomputes_a_request_the_host_preempted(name):
    policy = make_policy(name, cfg(), 40)
    rng = random.Random(3)
    work = [(req(i, rng.randint(3, 20), rng.randint(2, 30), arrival=rng.randint(0, 10)), rng.randint(2, 30))
            for i in range(10)]
    real_update, dropped = policy.update, []

    def update(plan, finished, now):
        real_update(plan, finished, now)
        if int(now) % 7 == 6:  # now and then, the request with the most KV loses it
            live = [r for r in policy.requests.values() if r.computed > 0]
            if live:
                victim = max(live, key=lambda r: (r.computed, r.rid))
                assert policy.host_preempted(victim.rid, now)
                assert victim.computed == 0 and policy.kv.of(victim.rid) == 0, (name, victim)
                dropped.append(victim.rid)

    policy.update = update
    run = drive(policy, work)
    assert dropped and set(run.done) == {r.rid for r, _ in work}
    assert not policy.host_preempted(dropped[0], 1e9)  # finished: unknown to the policy now
