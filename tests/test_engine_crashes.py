"""Requests that took a real engine down, on a real vLLM-CPU engine serving a base and two LoRA adapters (dummy-weight
Llama, random adapters), started by ``lengthwise serve --models``.

- The root cause: vLLM 0.32 computes prompt logprobs with one LoRA row per request in the step, and its engine core
  died when such a request shared a prefill step with any other request on an engine with LoRA on (stock vLLM too:
  vllm-project/vllm#16668). The plug-in now runs each such step alone; the gateway refuses them by default.
- Every sampling and output option the gateway forwards, tried beside a running request (a property): the engine
  survives each, or the gateway refuses it. The default tier tries the ``lengthwise`` policy; ``make test-slow`` every
  policy of the plug-in.
- An engine crashed by a request (vLLM's own scheduler, the gateway told to let prompt logprobs through) comes back,
  the requests that had not started are answered, and the request that crashed it twice is refused (slow).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import psutil
import pytest

from tests.gateway_proc import Gateway, start_gateway

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

ENGINE_ARGS = ["--load-format dummy", "--enforce-eager", "--max-model-len 1024", "--max-num-seqs 4",
               "--max-num-batched-tokens 256"]
PROMPT = "Once upon a time there was a dragon who lived in a cave near the sea, and every morning it"
STOCK_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    from serving.launch.adapters import random_adapters

    return random_adapters(model_dir, ["terse", "long"], tmp_path_factory.mktemp("adapters"))


def catalogue(path: Path, model_dir: Path, adapters: dict[str, Path], engine_args: list[str] = ENGINE_ARGS) -> Path:
    path.write_text(json.dumps({"models": [
        {"name": "lora-base", "model": str(model_dir), "engine_args": engine_args},
        {"name": "terse", "adapter_of": "lora-base", "adapter": str(adapters["terse"])},
        {"name": "long", "adapter_of": "lora-base", "adapter": str(adapters["long"])}]}))  # JSON is YAML too
    return path


def lora_gateway(tmp: Path, model_dir: Path, adapters: dict[str, Path], *args: str, policy: str = "lengthwise",
                 engine_args: list[str] = ENGINE_ARGS) -> Gateway:
    gw = start_gateway(tmp, "--models", str(catalogue(tmp / "models.yaml", model_dir, adapters, engine_args)),
                       "--policy", policy, "--engine-log-dir", str(tmp / "engines"), "--health-interval", "0.5",
                       "--engine-start-timeout", "300", "--engine-start-retries", "0", *args,
                       env={"VLLM_CPU_KVCACHE_SPACE": "1", "LENGTHWISE_API_KEY": "", "LENGTHWISE_ENGINE_API_KEY": ""},
                       wait=None)
    gw.wait_ready(timeout=420)
    gw.engine_logs = [tmp / "engines" / "engine-0.log"]
    return gw


def engine_key(gw: Gateway) -> str:
    keys = {p.environ().get("VLLM_API_KEY") for p in psutil.Process(gw.proc.pid).children(recursive=True)} - {None}
    assert len(keys) == 1
    return keys.pop()


@pytest.fixture(scope="module")
def lora_gw(model_dir, adapters, tmp_path_factory) -> Gateway:
    """The module's engine, with the plug-in's ``lengthwise`` policy, behind a gateway that lets prompt logprobs
    through to it (--allow-prompt-logprobs-with-lora)."""
    gw = lora_gateway(tmp_path_factory.mktemp("lora-gw"), model_dir, adapters, "--allow-prompt-logprobs-with-lora")
    yield gw
    gw.stop()


class Background:
    """A streamed request decoding on the engine while another is tried beside it: started, and its first event read,
    before :meth:`__enter__` returns; :meth:`__exit__` reads it to its end."""

    def __init__(self, gw: Gateway, model: str = "long", tokens: int = 48) -> None:
        self.gw, self.model, self.tokens = gw, model, tokens
        self.first, self.events, self.result = threading.Event(), 0, None

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "A story:", "max_tokens": self.tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.gw.url + "/v1/completions", json=body, timeout=300) as r:
                self.status, lines = r.status_code, []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        self.first.set()
                self.result = lines
        except httpx.HTTPError as exc:
            self.result = exc
        finally:
            self.first.set()

    def __enter__(self) -> Self:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.first.wait(120), "the background request never started"
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(300)

    @property
    def completed(self) -> bool:
        """It ran to its end: ``[DONE]`` after a usage chunk with all its tokens."""
        if not isinstance(self.result, list) or not self.result or self.result[-1] != "[DONE]":
            return False
        usage = [json.loads(d)["usage"] for d in self.result[:-1] if json.loads(d).get("usage")]
        return bool(usage) and usage[-1]["completion_tokens"] == self.tokens


def _prompt_logprobs(answer: dict) -> list:
    positions = answer["choices"][0]["prompt_logprobs"]
    return [{k: round(v["logprob"], 3) for k, v in pos.items()} if pos else None for pos in positions]


# --- the root cause ------------------------------------------------------------------------------------------------
def test_prompt_logprobs_beside_a_running_request_on_a_lora_engine_are_served_and_right(lora_gw):
    """Before the plug-in's fix the second request below killed the engine core (both answered 500, the engine process
    gone). Now both are served, and the prompt logprobs beside another request (of another adapter) are the ones the
    request gets alone: its prefill steps ran alone."""
    gw = lora_gw
    ask = {"model": "terse", "prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 2, "temperature": 0}
    alone = gw.post("/v1/completions", json=ask)
    assert alone.status_code == 200, alone.text
    with Background(gw) as bg:
        beside = gw.post("/v1/completions", json=ask)
        echo = gw.post("/v1/completions", json={"model": "lora-base", "prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                "logprobs": 2})
        chat = gw.post("/v1/chat/completions", json={"model": "long", "max_tokens": 3, "echo": True,
                                                     "messages": [{"role": "user", "content": PROMPT}]})
    assert bg.completed, bg.result
    assert [r.status_code for r in (beside, echo, chat)] == [200, 200, 200], [beside.text, echo.text, chat.text]
    assert _prompt_logprobs(beside.json()) == _prompt_logprobs(alone.json())
    # whether a step needed cutting depends on the policy's plan (tests/test_engine_adapter.py pins the rule); the
    # count is exported
    assert "lengthwise_scheduler_alone_steps_total" in gw.get("/metrics").text
    assert gw.metric("lengthwise_gateway_engine_exits_total") == 0
    assert gw.get("/health").json()["healthy_engines"] == 1


def test_a_gateway_refuses_prompt_logprobs_for_engines_serving_adapters_unless_allowed(lora_gw, tmp_path):
    """Attached to the same engine, without --allow-prompt-logprobs-with-lora: what vLLM's engine may die on is a 400
    that says why, for every way of asking (prompt_logprobs; echo with logprobs; chat's echo); everything else passes."""
    gw = start_gateway(tmp_path, "--engine-url", lora_gw.get("/health").json()["engines"][0]["url"], "--engine-api-key",
                       engine_key(lora_gw), env={"LENGTHWISE_API_KEY": ""})
    try:
        asks = [("/v1/completions", {"model": "terse", "prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
                ("/v1/completions", {"model": "lora-base", "prompt": PROMPT, "echo": True, "logprobs": 0}, "echo"),
                ("/v1/chat/completions", {"model": "long", "echo": True,
                                          "messages": [{"role": "user", "content": PROMPT}]}, "echo")]
        for path, body, field in asks:
            r = gw.post(path, json={**body, "max_tokens": 3})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and err["code"] == "unsupported_parameter" and "LoRA adapters" in err["message"]
        ok = gw.post("/v1/completions", json={"model": "terse", "prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
        assert ok.status_code == 200, ok.text
        assert gw.metric("lengthwise_gateway_rejected_total", reason="engine_defect") == 3
    finally:
        gw.stop()


# --- every option the gateway forwards, beside a running request ----------------------------------------------------
def _options():
    """Hypothesis strategies for the sampling and output options of vLLM 0.32's completions and chat requests, with
    values vLLM's schema takes (the type errors are tests/test_gateway_hostile.py's): (shared, completion only, chat
    only). ``model`` picks the base or an adapter; the prompt is short, the answers at most 16 tokens."""
    from hypothesis import strategies as st

    vocab = st.integers(0, 50256)
    text = st.text(alphabet="abc .,!\n", min_size=1, max_size=6)
    shared = {
        "prompt_logprobs": st.sampled_from([-1, 0, 1, 5]), "n": st.integers(1, 4), "use_beam_search": st.booleans(),
        "length_penalty": st.floats(0.5, 2.0), "min_tokens": st.integers(0, 16), "stop_token_ids": st.lists(vocab, max_size=4),
        "stop": st.lists(text, max_size=3), "ignore_eos": st.booleans(), "echo": st.booleans(),
        "truncate_prompt_tokens": st.sampled_from([-1, 1, 4, 16]),
        "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,5}"},
                                               {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}]),
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
        "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0), "top_k": st.sampled_from([-1, 0, 1, 20]),
        "min_p": st.floats(0.0, 0.5), "repetition_penalty": st.floats(0.5, 2.0), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "seed": st.integers(0, 2**31), "priority": st.integers(-5, 5),
        "logit_bias": st.dictionaries(vocab.map(str), st.floats(-100, 100), max_size=3),
        "allowed_token_ids": st.lists(vocab, min_size=1, max_size=8), "bad_words": st.lists(text, max_size=2),
        "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
        "return_tokens_as_token_ids": st.booleans(), "return_token_ids": st.booleans(),
        "spaces_between_special_tokens": st.booleans(), "add_special_tokens": st.booleans(),
    }
    completion = {"logprobs": st.integers(0, 5), "best_of": st.integers(1, 4), "suffix": text,
                  "max_tokens": st.integers(1, 16)}
    chat = {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 16),
            "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()}
    return shared, completion, chat


def probe_fields(gw: Gateway, examples: int, seen: dict) -> None:
    """Each example: a request of up to four options beside a running one; the engine must live through it (or the
    gateway refuse it with a 4xx), the running request end whole and the next plain request be served."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    shared, completion, chat = _options()
    seen["fields"] = len(set(shared) | set(completion) | set(chat))

    @st.composite
    def request(draw):
        kind = draw(st.sampled_from(["completion", "chat"]))
        options = {**shared, **(completion if kind == "completion" else chat)}
        names = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=4, unique=True))
        body = {name: draw(options[name]) for name in names}
        body.setdefault("max_tokens" if kind == "completion" else "max_completion_tokens", 8)
        body["model"] = draw(st.sampled_from(["lora-base", "terse", "long"]))
        body["stream"] = draw(st.booleans())
        if kind == "completion":
            body["prompt"] = PROMPT
        else:
            body["messages"] = [{"role": "user", "content": PROMPT}]
            if body.get("continue_final_message"):
                body["messages"].append({"role": "assistant", "content": "Well,"})
                body["add_generation_prompt"] = False
        return kind, body

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request())
    def one(case) -> None:
        kind, body = case
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        with Background(gw) as bg:
            try:
                r = httpx.post(gw.url + path, json=body, timeout=300)
                status, text = r.status_code, r.text
            except httpx.HTTPError as exc:
                status, text = type(exc).__name__, ""
        seen.setdefault("status", {}).setdefault(str(status), 0)
        seen["status"][str(status)] += 1
        assert isinstance(status, int) and status < 500, (body, status, text[:400])
        if status == 200 and body["stream"]:
            assert text.rstrip().endswith("data: [DONE]"), (body, text[-300:])
        assert bg.completed, (body, bg.result)
        assert gw.metric("lengthwise_gateway_engine_exits_total") == 0, (body, gw.get("/health").json())
        plain = gw.post("/v1/completions", json={"model": "lora-base", "prompt": "hi", "max_tokens": 2})
        assert plain.status_code == 200, (body, plain.text)

    one()


def test_every_option_beside_a_running_request_leaves_the_engine_serving(lora_gw):
    """The property over 38 options of vLLM's request schemas (``make test-slow`` runs it under every policy)."""
    seen: dict = {}
    probe_fields(lora_gw, 30, seen)
    assert seen["fields"] == 38 and sum(seen["status"].values()) >= 30, seen


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["vllm", "orca", "sarathi", "sjf", "seallm", "muxserve", "fcfs-max-alloc", "ecoserve",
                                    "lengthwise-sjf", "lengthwise-fcfs"])
def test_every_option_under_every_policy(policy, model_dir, adapters, tmp_path):
    """The property above under each other policy of the plug-in (the default tier runs ``lengthwise``)."""
    gw = lora_gateway(tmp_path, model_dir, adapters, "--allow-prompt-logprobs-with-lora", policy=policy)
    try:
        seen: dict = {}
        probe_fields(gw, 20, seen)
        assert sum(seen["status"].values()) >= 20, seen
    finally:
        gw.stop()


# --- an engine crashed by a request, under load ---------------------------------------------------------------------
class Load:
    """Requests that keep ``width`` non-streamed answers in flight, each with its own prompt, until stopped: (status,
    completion tokens) of each."""

    def __init__(self, gw: Gateway, width: int = 2, tokens: int = 24) -> None:
        self.gw, self.width, self.tokens = gw, width, tokens
        self.results: list[tuple[int | str, int | None]] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(width)]

    def _run(self, k: int) -> None:
        i = 0
        while not self.stopping.is_set():
            body = {"model": "lora-base", "prompt": f"Request {k}-{i}: tell a story", "max_tokens": self.tokens,
                    "ignore_eos": True}
            try:
                r = httpx.post(self.gw.url + "/v1/completions", json=body, timeout=600)
                tokens = (r.json()["usage"]["completion_tokens"] if r.status_code == 200
                          else f"{r.headers.get('x-lengthwise-request-id')}: {r.text[:300]}")
                self.results.append((r.status_code, tokens))
            except httpx.HTTPError as exc:
                self.results.append((type(exc).__name__, None))
            i += 1

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(600)


@pytest.mark.slow
@pytest.mark.fault("an engine crashed by a request (vLLM's own scheduler, prompt logprobs let through) under load",
                   saw="the requests that had not started: answered after the restart; the crashing request: 400 "
                       "(request_quarantined) after its third crash, and at once when sent again",
                   lost="nothing that had not started")
def test_an_engine_crashed_by_a_request_comes_back_and_the_request_is_refused(model_dir, adapters, tmp_path):
    """vLLM's own scheduler (the plug-in's fix off) and a gateway told to let prompt logprobs through: the prompt
    logprobs request kills the engine core each time it shares a step with the load. The gateway starts the engine
    again each time; the load's requests (non-streamed: none had sent its client anything) are all answered; the
    crashing request is refused once the engine died while it ran on probation, and then at once, before any engine
    sees it. (On probation it runs alone among suspects only: alone in the engine, it is answered, and its next send
    is tried again; at most a few sends.)"""
    gw = lora_gateway(tmp_path, model_dir, adapters, "--allow-prompt-logprobs-with-lora", "--restart-wait", "240",
                      engine_args=[*ENGINE_ARGS, f"--scheduler-cls {STOCK_SCHEDULER}"])
    try:
        crasher = {"model": "terse", "prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1}
        sends = []
        with Load(gw, width=3) as load:
            while len(load.results) < 3:  # the load is running
                time.sleep(0.2)
            for _ in range(4):
                r = httpx.post(gw.url + "/v1/completions", json=crasher, timeout=900)
                sends.append(r.status_code)
                if r.status_code == 400:
                    break
        assert sends[-1] == 400 and r.json()["error"]["code"] == "request_quarantined", (sends, r.text)
        assert "was on engines when they died 3 times" in r.json()["error"]["message"]
        h = wait_for_health(gw)
        exits = gw.metric("lengthwise_gateway_engine_exits_total")
        assert 3 <= exits <= 5 and h["engines"][0]["restarts"] == exits and h["quarantine"]["refused"] >= 1, (exits, h)
        assert load.results and all(res == (200, load.tokens) for res in load.results), [
            res for res in load.results if res[0] != 200]  # lost: 0
        again = gw.post("/v1/completions", json=crasher)
        assert again.status_code == 400 and again.json()["error"]["code"] == "request_quarantined"
        assert gw.metric("lengthwise_gateway_engine_exits_total") == exits, "refused before any engine saw it"
        log = (tmp_path / "engines" / "engine-0.log").read_text(errors="replace")
        assert log.count("--- started again: ") == exits and "bgmv_shrink" in log
        print(f"crasher sends {sends}, engine exits {exits}, load answers {len(load.results)}")
    finally:
        gw.stop()


def wait_for_health(gw: Gateway, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = gw.get("/health").json()
        if h["healthy_engines"] == 1 and h["status"] == "ok":
            return h
        time.sleep(0.5)
    raise AssertionError(f"the engine did not come back: {gw.get('/health').json()}")
