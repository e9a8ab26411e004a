"""MuxServe's ADBS (their policy in our code, serving/policy/muxserve.py): services admitted round-robin, each within its
KV quota without holding the others back, quotas moved from idle services to held-back ones, and the victim taken from
the service furthest over its quota."""

from __future__ import annotations

import pytest

from serving.policy import muxserve
from serving.policy.registry import make_policy
from tests.test_policy import cfg, drive, req

pytestmark = pytest.mark.unit


def test_services_are_admitted_round_robin_not_first_come_first_served():
    policy = make_policy("muxserve", cfg(max_num_batched_tokens=8), 4096)  # one 8-token prompt a step
    reqs = [(req(i, 8, 5.0, service="a"), 5) for i in range(4)] + [(req(10 + i, 8, 5.0, service="b"), 5) for i in range(2)]
    run = drive(policy, reqs, arrivals=[0] * len(reqs))
    order = sorted(run.first, key=run.first.get)
    assert order[:4] == [0, 10, 1, 11]  # a, b, a, b although every a arrived before every b
    fcfs = drive(make_policy("vllm", cfg(max_num_batched_tokens=8), 4096),
                 [(req(r.rid, 8, 5.0, service=r.service), n) for r, n in reqs], arrivals=[0] * len(reqs))
    assert sorted(fcfs.first, key=fcfs.first.get)[:4] == [0, 1, 2, 3]


def test_a_service_over_its_quota_waits_without_holding_the_others_back():
    # 64 blocks of 4 tokens; max_model_len 64 makes the floor of a quota 16 blocks
    policy = make_policy("muxserve", cfg(max_model_len=64, max_num_batched_tokens=512), 64)
    for rid, service in [(1, "a"), (2, "b")]:
        policy.add(req(rid, 4, 1.0, service=service), 0.0)
    assert policy.quota == {"a": 32, "b": 32}  # one arrival each: half the pool each
    policy.schedule(0.0)
    big = [req(10 + i, 62, 1.0, service="a") for i in range(3)]  # 16 blocks each: a holds 2, so one more fits its 32
    for r in big:
        policy.add(r, 1.0)
    policy.add(small := req(20, 8, 1.0, service="b"), 1.0)
    plan = policy.schedule(1.0)
    assert big[0].rid in plan.tokens and small.rid in plan.tokens  # b admitted beside a's first
    assert big[1].rid not in plan.tokens and big[2].rid not in plan.tokens  # a's quota full, the pool is not
    assert policy.kv.free >= 16 and policy.used("a") <= policy.quota["a"]
    assert [r.rid for r in policy.waiting] == [big[1].rid, big[2].rid]  # deferred, not dropped, in their order


def test_quota_moves_from_an_idle_service_to_a_held_back_one(monkeypatch):
    monkeypatch.setattr(muxserve, "QUOTA_PERIOD", 1)
    policy = make_policy("muxserve", cfg(max_model_len=64, max_num_batched_tokens=512), 64)
    policy.add(req(1, 4, 1.0, service="idle"), 0.0)
    policy.add(req(2, 4, 1.0, service="busy"), 0.0)
    policy.schedule(0.0)
    for i in range(3):
        policy.add(req(10 + i, 62, 1.0, service="busy"), 1.0)
    policy.schedule(1.0)  # busy's second and third wait on its quota: held back
    before = dict(policy.quota)
    policy.schedule(2.0)  # the period's move
    assert policy.quota["busy"] > before["busy"] and policy.quota["idle"] < before["idle"]
    assert sum(policy.quota.values()) == sum(before.values())  # moved, not made


def test_under_kv_pressure_the_victim_comes_from_the_service_furthest_over_its_quota():
    policy = make_policy("muxserve", cfg(max_model_len=64, max_num_batched_tokens=512), 64)
    policy.add(req(1, 4, 1.0, service="a"), 0.0)
    policy.add(req(2, 4, 1.0, service="b"), 0.0)
    policy.schedule(0.0)
    policy.quota = {"a": 8, "b": 56}  # a far over its quota, b well within
    policy.add(req(3, 4, 1.0, arrival=1, service="b"), 1.0)
    assert policy._victim().service == "a"


def test_every_request_of_every_service_finishes_under_a_tight_pool():
    policy = make_policy("muxserve", cfg(max_model_len=64, max_num_batched_tokens=32), 40)
    reqs = [(req(i, 6 + i % 5, 10.0, service="abc"[i % 3]), 4 + (7 * i) % 30) for i in range(30)]
    run = drive(policy, reqs, arrivals=[i // 4 for i in range(30)])
    assert set(run.done) == set(range(30)) and all(run.emitted[r.rid] == n for r, n in reqs)
