"""Replay a timed trace through one real vLLM engine and record when every token came out.

Run as ``python -m serving.bench.engine.replay JOB.json OUT.json`` (one engine per process: vLLM keeps
process-wide state), or as ``python -m serving.bench.engine.replay --serve``, which reads ``JOB.json OUT.json`` lines on
its standard input and replays each on one engine started for the first, answering ``DONE_MARK OUT.json`` on its
standard output: on one GPU the bench runs engines one after another, and an 8B engine's start costs more than a
replay. Between two jobs the prefix cache is emptied, so a replay never finds the previous one's prompts cached.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the loop
below is an online server's: between steps it admits the requests whose arrival time has passed, so a
request arriving mid-step waits for the step boundary exactly as it would behind ``vllm serve``.
Every request has the same ``max_tokens``, the job's cap, with stock scheduling and with the plug-in. With random
weights (``load_format="dummy"``) its true length is enforced by a logits processor in the sampler
(:mod:`serving.bench.engine.exactlen`) that ends it with a stop token at exactly that length, out of the scheduler's
sight. With a real model (the job's ``engine.model``) a request ends where the model ends it (end of sequence or the
cap), sampled with the job's settings and the request's own seed, so a seeded relabel reproduces its length. Each
record says what vLLM and the plug-in saw of the request (``max_tokens``, the plug-in's predicted length and cap) and
why it finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the loop below reads the scheduler in this process
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# The length processor (serving.bench.engine.exactlen) has vLLM's V1 logits-processor interface, which the V2 model runner
# (vLLM 0.32's default on CUDA with Triton) refuses at load; the CPU build, without Triton, runs the V1 runner anyway.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

from serving.launch.models import bench_dtype, dummy_model

STOCK = "serving.engine.profile.ProfiledScheduler"
STOCK_ASYNC = "serving.engine.profile.ProfiledAsyncScheduler"
OURS = "serving.engine.profile.ProfiledLengthwiseScheduler"
DONE_MARK = "@@lengthwise-replay-done"
"""The line prefix ``--serve`` answers a finished job with (the engine's own logs share standard output)."""


def engine_key(job: dict[str, Any]) -> str:
    """What decides the engine a job needs: two jobs with the same key can share one engine process (``process``
    names a second process of the same engine, e.g. stock again, whose runs measure the noise between two)."""
    plugin = job.get("plugin", {}) if job["scheduler"] != "stock" else {}  # stock vLLM reads no plug-in settings
    return json.dumps({"engine": job["engine"], "scheduler": job["scheduler"], "plugin": plugin,
                       "process": job.get("process", "")}, sort_keys=True)


def scheduler_cls(job: dict[str, Any]) -> str:
    """The recorded scheduler class: the plug-in, or stock vLLM in the engine's scheduling mode (async scheduling, which
    vLLM turns on by itself on CUDA, needs vLLM's AsyncScheduler; the CPU build runs synchronously)."""
    if job["scheduler"] != "stock":
        return OURS
    return STOCK_ASYNC if job["engine"].get("async_scheduling") else STOCK


def _engine(job: dict[str, Any]):
    from vllm import LLM

    from serving.bench.engine.exactlen import ExactLengthLogitsProcessor
    from serving.engine import seeded

    seeded.install()  # seeded requests with chunked prompts would kill a vLLM-CPU engine otherwise
    e = job["engine"]
    if job["scheduler"] != "stock":
        os.environ["LENGTHWISE_SCHEDULER_CONFIG"] = json.dumps({"policy": job["scheduler"], **job.get("plugin", {})})
    if e.get("model"):  # real weights: the model's own tokenizer knows its end-of-sequence token
        weights = {"model": e["model"]}
    else:
        weights = {"model": dummy_model(e["shape"], e["max_model_len"], tokenizer_json=e.get("tokenizer_json")),
                   "load_format": "dummy", "skip_tokenizer_init": True, "logits_processors": [ExactLengthLogitsProcessor]}
    if e.get("async_scheduling") is not None:
        weights["async_scheduling"] = bool(e["async_scheduling"])
    if e.get("loras"):  # several services: the base and these adapters, all in one batch and one KV pool
        weights.update(enable_lora=True, max_loras=len(e["loras"]), max_lora_rank=int(e["max_lora_rank"]))
    llm = LLM(**weights, dtype=e.get("dtype") or bench_dtype(), enforce_eager=not e.get("cuda_graphs"), seed=0,
              gpu_memory_utilization=e.get("gpu_memory_utilization", 0.2), block_size=e["block_size"],
              max_model_len=e["max_model_len"], max_num_seqs=e["max_num_seqs"],
              max_num_batched_tokens=e["max_num_batched_tokens"], num_gpu_blocks_override=e["kv_blocks"],
              enable_prefix_caching=e.get("prefix_caching", True), scheduler_cls=scheduler_cls(job))
    return llm.llm_engine


def _seen(sched, request_id: str) -> dict[str, Any]:
    """What the scheduler got of a request just added: vLLM's ``max_tokens``, and with the plug-in the predicted length
    and the cap its policy holds (read from the plug-in's own maps: the bench checks that the truth never reaches it).
    A request the plug-in rejected on arrival (it can never fit the KV pool) is gone already: nothing seen."""
    vreq = sched.requests.get(request_id)
    seen: dict[str, Any] = {"max_tokens": None if vreq is None else vreq.max_tokens}
    rid = getattr(sched, "_rid_of", {}).get(request_id)
    if rid is not None:
        twin = sched.lw_policy.requests[rid]
        seen.update(policy_pred_len=twin.pred.length, policy_max_tokens=twin.max_tokens)
    return seen


def _prompt(i: int, n: int) -> dict:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[3 + (7919 * i + 31 * j) % 4000 for j in range(n)])  # distinct per request


def _warm(engine, n: int = 4) -> None:
    """A few requests before the clock starts, so first-call costs do not land on the trace."""
    from vllm import SamplingParams

    for i in range(n):
        engine.add_request(f"warm-{time.monotonic_ns()}-{i}", _prompt(10_000 + i, 64 + 32 * i),
                           SamplingParams(max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _empty_prefix_cache(engine, steps: int = 100) -> None:
    """Empty the prefix cache of an engine that replayed a job before: first let it send the last finished requests
    through (under async scheduling a step may still be queued), since vLLM refuses while blocks are in use."""
    for _ in range(steps):
        if engine.reset_prefix_cache():
            return
        engine.step()
    raise RuntimeError("replay: the engine's prefix cache could not be emptied between two replays")


def _params(job: dict[str, Any], r: dict[str, Any], xargs: dict[str, Any]):
    """One request's sampling: the real model's served settings with the request's own seed, or (random weights)
    greedy with its true length enforced out of the scheduler's sight."""
    from vllm import SamplingParams

    from serving.bench.engine.exactlen import exact_length_params

    cap = int(job["max_tokens"])
    if "seed" in r:
        return SamplingParams(max_tokens=cap, seed=int(r["seed"]), extra_args=xargs or None, detokenize=False,
                              **job["sampling"])
    return exact_length_params(r["output_tokens"], cap, xargs)


def _lora(job: dict[str, Any], name: str | None):
    """The request's adapter (None: the base model), numbered by its place in the engine's list as vLLM wants."""
    if name is None:
        return None
    from vllm.lora.request import LoRARequest

    names = list(job["engine"]["loras"])
    return LoRARequest(name, names.index(name) + 1, job["engine"]["loras"][name])


def _request_prompt(r: dict[str, Any]):
    from vllm.inputs import TokensPrompt

    if "prompt_ids" in r:
        return TokensPrompt(prompt_token_ids=[int(t) for t in r["prompt_ids"]])
    return _prompt(int(r["id"]), r["prompt_tokens"])


def replay(job: dict[str, Any], progress: bool = True, engine=None, reuse: bool = False) -> dict[str, Any]:
    """Run ``job["requests"]`` (id, arrival, prompt_tokens, output_tokens, extra_args, slo_s; with a real model also
    prompt_ids and seed) on one engine, every request with ``max_tokens`` = ``job["max_tokens"]``; ``engine``: one
    started for a job of the same :func:`engine_key`; ``reuse``: it replayed one already, so its prefix cache is
    emptied first."""

    if engine is None:
        engine = _engine(job)
    if reuse:
        _empty_prefix_cache(engine)
    sched = engine.engine_core.engine_core.scheduler
    _warm(engine)
    sched.profile_rows.clear()
    sched.profile_preemptions = 0
    sched.profile_preempted.clear()
    if hasattr(sched, "lw_stats"):  # the warm-up requests are not the trace's
        for counters in (sched.lw_stats, sched.lw_policy.stats):
            for k in counters:
                counters[k] = 0
    reqs = sorted(job["requests"], key=lambda r: (r["arrival"], r["id"]))
    rec: dict[str, dict[str, Any]] = {}
    internal: dict[str, str] = {}  # the request's id -> the id vLLM gave it (which may carry a suffix)
    t0 = time.time()
    nxt, done, total = 0, 0, len(reqs)
    last_print = t0
    while nxt < total or engine.has_unfinished_requests():
        now = time.time() - t0
        while nxt < total and reqs[nxt]["arrival"] <= now:
            r = reqs[nxt]
            xargs = dict(r.get("extra_args") or {})
            if r.get("slo_s") is not None:
                xargs["deadline"] = t0 + r["arrival"] + r["slo_s"]  # the absolute deadline the gateway would set
            iid = engine.add_request(str(r["id"]), _request_prompt(r), _params(job, r, xargs),
                                     lora_request=_lora(job, r.get("lora")))
            rec[str(r["id"])] = {"id": r["id"], "arrival": r["arrival"], "added": now, "first": None, "finished": None,
                                 "tokens": 0, **_seen(sched, iid)}
            internal[str(r["id"])] = iid
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[nxt]["arrival"] - (time.time() - t0)))
            continue
        outs = engine.step()
        t = time.time() - t0
        for o in outs:
            r = rec[o.request_id]
            n = len(o.outputs[0].token_ids)
            if n and r["first"] is None:
                r["first"] = t
            r["tokens"] = n
            if o.finished:
                r["finished"] = t
                r["finish_reason"], r["stop_reason"] = o.outputs[0].finish_reason, o.outputs[0].stop_reason
                done += 1
        if progress and time.time() - last_print > 5:
            last_print = time.time()
            print(f"  [{job['scheduler']}] t={t:6.1f}s arrived {nxt}/{total} finished {done}", file=sys.stderr, flush=True)
    wall = time.time() - t0
    for key, r in rec.items():
        r["preemptions"] = sched.profile_preempted.get(internal[key], 0)
    stats = sched.lengthwise_stats() if hasattr(sched, "lengthwise_stats") else {}
    return {"scheduler": job["scheduler"], "records": list(rec.values()), "profile": sched.step_rows(),
            "preemptions": sched.profile_preemptions, "plugin_stats": stats, "wall_s": wall,
            "kv_blocks": sched.kv_cache_config.num_blocks}


def serve(lines=sys.stdin) -> None:
    """``--serve``: one engine, many jobs of one :func:`engine_key`, each named on a line ``JOB.json OUT.json``."""
    engine, key = None, None
    for line in lines:
        if not line.strip():
            continue
        job_path, out_path = line.split()
        job = json.loads(Path(job_path).read_text())
        if key is not None and engine_key(job) != key:
            raise SystemExit(f"replay --serve: {job_path} needs another engine than the jobs before it")
        key = engine_key(job)
        fresh = engine is None
        if fresh:
            engine = _engine(job)
        out = replay(job, engine=engine, reuse=not fresh)
        Path(out_path).write_text(json.dumps(out))
        print(f"{DONE_MARK} {out_path}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    job = json.loads(Path(sys.argv[1]).read_text())
    out = replay(job)
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
