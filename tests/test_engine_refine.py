"""Refined predictions reach a running request through the plug-in's own port (real HTTP, vLLM 0.32's real scheduler).

The gateway tags a request with ``ref`` in ``vllm_xargs``; a refinement posted for that ref is queued and handed to
the policy at the next step, as a prediction of the whole length. Nothing else is touched: a request that gets no
update keeps its prediction, and an update for a request that is gone is refused with 404 and holds no memory.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

from serving.engine.channel import MAX_BODY, RefinementInbox
from serving.engine.scheduler import LengthwiseScheduler
from serving.engine.settings import ENV
from serving.launch.process import free_port
from serving.policy.hints import Refinement
from serving.policy.request import after
from tests.vllm_harness import make_request, make_scheduler, run_to_completion, step

pytestmark = pytest.mark.unit

EDGES, PROBS = (16, 64, 256), (0.1, 0.2, 0.6, 0.1)


def _scheduler(monkeypatch, key: str | None = None, policy: str = "lengthwise-posterior"):
    port = free_port()
    monkeypatch.setenv(ENV, json.dumps({"policy": policy, "metrics_port": port}))
    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    s = make_scheduler(num_blocks=200, scheduler_cls=LengthwiseScheduler)
    return s, f"http://127.0.0.1:{port}"


def _post(url: str, body: bytes | dict, key: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/refine", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _update(ref: str, generated: int = 20, pred_len: float = 300.0) -> dict:
    return {"ref": ref, "generated_tokens": generated, "pred_len": pred_len, "pred_edges": EDGES, "pred_probs": PROBS}


def test_a_refinement_replaces_the_running_requests_prediction_at_the_next_step(monkeypatch):
    s, url = _scheduler(monkeypatch)
    try:
        tagged = make_request("a", 10, 120, extra_args={"pred_len": 40, "ref": "gw-a"})
        other = make_request("b", 10, 60, extra_args={"pred_len": 50, "ref": "gw-b"})
        plain = make_request("c", 10, 30, extra_args={"pred_len": 30})
        for r in (tagged, other, plain):
            s.add_request(r)
        twins = {k: s.lw_policy.requests[rid] for k, rid in s._rid_of.items()}
        for _ in range(3):
            step(s)
        assert _post(url, _update("gw-a", generated=20, pred_len=300.0)) == (202, {"queued": True})
        assert twins["a"].pred.length == 40  # queued, not applied: the policy is the scheduler thread's alone
        step(s)
        assert twins["a"].pred.length == 120  # 20 written + 300 to come, capped at its max_tokens
        assert twins["a"].pred.edges == (36, 84, 276) and twins["a"].pred.probs == PROBS
        assert twins["b"].pred.length == 50 and twins["c"].pred.length == 30  # no update: untouched
        assert s.lw_stats["refinements_applied"] == 1 and s.lw_policy.stats["refinements"] == 1
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert "lengthwise_scheduler_refinements_received_total" in metrics
        assert "lengthwise_scheduler_refinements_applied_total" in metrics
        run = run_to_completion(s, [])
        assert all(res.finish_reason == "length" for res in run.requests.values())  # nothing lost or cut
        status, body = _post(url, _update("gw-a"))  # the request finished: nobody to update, nothing kept
        assert status == 404 and "gw-a" in body["error"]["message"]
        assert s.lw_inbox.live == 0 and s.lw_inbox.take() == [] and s.lw_inbox.counts["refinements_unknown"] == 1
    finally:
        s.shutdown()


def test_the_port_wants_the_engines_key_and_refuses_what_is_not_a_refinement(monkeypatch):
    s, url = _scheduler(monkeypatch, key="engine-secret")
    try:
        s.add_request(make_request("a", 10, 40, extra_args={"pred_len": 40, "ref": "gw-a"}))
        assert _post(url, _update("gw-a"))[0] == 401
        assert _post(url, _update("gw-a"), key="wrong")[0] == 401
        status, body = _post(url, {**_update("gw-a"), "pred_probs": [0.5, 0.5]}, key="engine-secret")
        assert status == 422 and "pred_probs" in body["error"]["message"]
        assert _post(url, b"{not json", key="engine-secret")[0] == 422
        assert _post(url, b"x" * (MAX_BODY + 1), key="engine-secret")[0] == 413
        assert _post(url, _update("gw-a"), key="engine-secret")[0] == 202
        assert s.lw_inbox.counts["refinements_received"] == 1
        both = {"refinements": [_update("gw-a", pred_len=9.0), _update("gw-gone")]}  # several in one call
        assert _post(url, both, key="engine-secret") == (200, {"queued": ["gw-a"], "unknown": ["gw-gone"]})
        assert [u.pred_len for _, u, _ in s.lw_inbox.take()] == [9.0]  # the newer update replaced the older
    finally:
        s.shutdown()


def test_the_inbox_keeps_one_update_per_running_request():
    inbox = RefinementInbox()
    inbox.open("x", 1)
    first, second = (Refinement.model_validate(_update("x", pred_len=n)) for n in (10.0, 90.0))
    assert inbox.offer(first) and inbox.offer(second)
    assert not inbox.offer(Refinement.model_validate(_update("nobody")))
    taken = inbox.take()
    assert [(rid, u.pred_len) for rid, u, _ in taken] == [(1, 90.0)] and inbox.counts["refinements_replaced"] == 1
    inbox.open("x", 2)  # a later request with the same ref: the earlier one's leaving does not close it
    inbox.close("x", 1)
    assert inbox.offer(first)
    inbox.close("x", 2)
    assert inbox.take() == [] and inbox.live == 0


def test_a_remaining_prediction_is_shifted_to_the_whole_length():
    p = after(64, 100.0, EDGES, PROBS, max_tokens=512)
    assert p.length == 164 and p.edges == (80, 128, 320) and p.probs == PROBS
    assert after(64, 0.0).length == 65  # at least one more token: the request is still running
    assert after(500, 100.0, max_tokens=512).length == 512
