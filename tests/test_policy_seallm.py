"""SeaLLM's doubling-budget order (their policy in our code, serving/policy/seallm.py): a service's profile learnt from
its finished requests, the budget that doubles when spent, and starved requests first."""

from __future__ import annotations

import pytest

from serving.policy.registry import make_policy
from serving.policy.seallm import ServiceProfile
from tests.test_policy import cfg, drive, req

pytestmark = pytest.mark.unit


def _learnt(policy, lengths: dict[str, list[int]]) -> None:
    """Finish requests of each service with these output lengths (the host's truth), one after another."""
    rid = 1000
    for service, ns in lengths.items():
        for n in ns:
            rid += 1
            drive(policy, [(req(rid, 4, 1.0, service=service), n)])


def test_the_profile_is_each_services_mean_and_spread_of_finished_lengths():
    p = ServiceProfile()
    for x in (10, 20, 30):
        p.add(x)
    assert (p.n, p.mean, p.std) == (3, 20.0, 10.0)
    policy = make_policy("seallm", cfg(), 4096)
    assert policy.profile("chat") == (1024 / 4, 0.0)  # nothing finished yet: a quarter of the context
    _learnt(policy, {"terse": [8, 12], "long": [100, 140]})
    assert policy.profile("terse") == (10.0, pytest.approx(2.828, abs=1e-3))
    assert policy.profile("long")[0] == 120.0
    assert policy.profile("new")[0] == pytest.approx(65.0)  # a service never seen: everyone's profile


def test_a_shorter_service_goes_first_and_its_own_length_is_never_read():
    policy = make_policy("seallm", cfg(max_num_seqs=1), 4096)
    _learnt(policy, {"terse": [8, 12], "long": [100, 140]})
    # the long service's request arrives first and predicts 1 token: SeaLLM reads neither prediction nor truth
    run = drive(policy, [(req(1, 4, 1.0, arrival=0, service="long"), 30), (req(2, 4, 500.0, arrival=0, service="terse"), 10)])
    assert run.first[2] < run.first[1]


def test_a_request_past_its_budget_gets_a_budget_twice_as_large_and_sinks():
    policy = make_policy("seallm", cfg(), 4096)
    _learnt(policy, {"s": [10, 10, 10]})  # L_s 10, V_s 0: budget 10
    r = req(1, 4, 1.0, service="s")
    policy.add(r, 0.0)
    fresh = policy._key(req(2, 4, 1.0, service="s"))
    assert policy._key(r) == fresh == (1, 100.0)  # Q x L_s = 10 x 10
    r.generated = 9
    assert policy._key(r) == (1, 10.0)  # one token of budget left: it runs first now
    r.generated = 10
    assert policy._key(r) == (1, 200.0)  # spent: a fresh budget of 20, behind any fresh request of the service
    r.generated = 30
    assert policy._key(r) == (1, 400.0)  # 20 spent too: 40


def test_a_starved_request_is_served_first():
    policy = make_policy("seallm", cfg(aging_s=5.0), 4096)
    _learnt(policy, {"terse": [5], "long": [500]})
    old = req(1, 4, 1.0, arrival=0, service="long")
    policy.add(old, 0.0)
    policy._now = 6.0
    assert policy._key(old)[0] == 0 < policy._key(req(2, 4, 1.0, arrival=6, service="terse"))[0]
