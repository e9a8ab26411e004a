"""Priority classes (a catalogue entry's ``priority``, carried to the engine as a scheduling hint): in every policy
that runs vLLM's loop a request of a lower class is admitted first and preempted last, whatever its arrival or
predicted length; the policy's own order holds within a class."""

from __future__ import annotations

import pytest

from serving.engine.inputs import parse_inputs
from serving.gateway.hints import our_xargs
from serving.gateway.prediction import LengthPrediction
from serving.policy.registry import make_policy
from tests.test_policy import cfg, drive, req

pytestmark = pytest.mark.unit

LOOP_POLICIES = ["vllm", "sarathi", "sjf", "lengthwise", "lengthwise-fcfs", "seallm"]


@pytest.mark.parametrize("name", LOOP_POLICIES)
def test_a_lower_class_is_admitted_first_even_late_and_long(name):
    policy = make_policy(name, cfg(max_num_seqs=1), 4096)
    # the class-1 request came first and is predicted short; the class-0 one came after and is predicted long
    run = drive(policy, [(req(1, 4, 1.0, arrival=0, priority=1), 5), (req(2, 4, 500.0, arrival=0, priority=0), 5),
                         (req(3, 4, 1.0, arrival=0, priority=1), 5)], arrivals=[0, 0, 0])
    assert run.first[2] < run.first[1] < run.first[3]  # within class 1: the policy's own order (here FCFS or SJF tie)


@pytest.mark.parametrize("name", ["vllm", "sjf"])
def test_under_kv_pressure_the_worst_class_is_preempted_not_the_newest(name):
    # 6 blocks of 4 tokens: two requests of 4 prompt tokens growing to 16 tokens each cannot both stay
    policy = make_policy(name, cfg(), 6)
    run = drive(policy, [(req(1, 4, 12.0, arrival=0, priority=1), 12), (req(2, 4, 12.0, arrival=0, priority=0), 12)],
                arrivals=[0, 1])
    assert run.lost.get(1, 0) > 0 and run.lost.get(2, 0) == 0, run.lost
    assert run.done[2] < run.done[1]


def test_the_class_travels_as_a_hint_and_the_engine_reads_it():
    pred = LengthPrediction(40, "sidecar")
    assert "priority" not in our_xargs(pred, 100.0)  # class 0, the default, is not sent
    xargs = our_xargs(pred, 100.0, priority=-2)
    assert xargs["priority"] == -2
    assert parse_inputs(xargs, arrival=0.0, max_tokens=None, default_pred_len=10).priority == -2
    assert parse_inputs({"pred_len": 5}, arrival=0.0, max_tokens=None, default_pred_len=10).priority == 0
    bad = parse_inputs({"pred_len": 5, "priority": 10**6}, arrival=0.0, max_tokens=None, default_pred_len=10)
    assert bad.invalid is not None and bad.invalid.startswith("priority") and bad.priority == 0
