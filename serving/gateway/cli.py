"""``lengthwise serve``: start (or attach to) vLLM engines with the lengthwise scheduler and serve the gateway.

Every flag sets one field of :class:`~serving.gateway.settings.GatewaySettings`, which defines the settings: a flag
takes its default and, for a value, its type from its field (:func:`_setting`), so the two cannot drift apart (the
flags' values are all passed on, so a flag's own default would win over the field's). The help texts are the
command line's own: they name flags and give examples where the fields' descriptions name fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import ValidationError

from serving.argtypes import comma_list, flag_error
from serving.engine.settings import SchedulerSettings
from serving.gateway.auth import KEY_ENV, read_key_file
from serving.gateway.settings import GatewaySettings
from serving.policy.base import PolicyError
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy, policy_help

if TYPE_CHECKING:
    from serving.gateway.target import TargetCheck

log = logging.getLogger("serving.gateway")

EPILOG = """\
examples:
  # two engines on this machine, predictions from a running sidecar
  lengthwise serve --model ./SmolLM2-135M-Instruct --engines 2 --predictor-url http://127.0.0.1:8100
  # attach to engines started elsewhere (with --scheduler-cls serving.engine.scheduler.LengthwiseScheduler)
  lengthwise serve --engine-url http://10.0.0.5:8001 --engine-url http://10.0.0.6:8001 --port 8000
  # disaggregated prefill: one engine prefills, two decode, KV moved by vLLM's connector (both kinds started with
  # --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}' or another connector)
  lengthwise serve --prefill-url http://10.0.0.4:8001 --engine-url http://10.0.0.5:8001 --engine-url http://10.0.0.6:8001 \
      --placement lengthwise
  # engine arguments: one string each (use = when it starts with --)
  lengthwise serve --model M --policy ecoserve --engine-arg="--max-model-len 4096" --engine-arg=--enforce-eager \\
      --scheduler-config '{"knobs": {"padding": 0.2}}'

clients use any OpenAI SDK against http://HOST:PORT/v1:
  curl -s localhost:8000/v1/chat/completions -H 'x-slo-ttft-ms: 500' -H 'x-slo-tpot-ms: 50' \\
      -d '{"model": "M", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}'

deadline per request: now + x-slo-ttft-ms + x-slo-tpot-ms x predicted length when the headers are given,
else slo_scale x (t_p + t_g x predicted length) (EcoServe's JCT SLO). Without --predictor-url, or when the
sidecar does not answer within --predictor-timeout-ms, the request runs on --fallback-tokens (counted in
lengthwise_gateway_prediction_fallbacks_total on /metrics).

which model the predictor is for: at start the gateway reads the sidecar's target model (the model whose lengths
its predictor learned, name@hash) and compares it with --model (name@hash of a local directory, else the name). A
predictor for another model is an error (exit 2) unless --allow-predictor-for-other-model; one that records no target
is a warning. The verdict is on /health (predictor_target) and re-checked every --predictor-check-interval s.

placement: each engine has a view of its requests (prompt tokens, predicted and generated tokens), plus
the requests other gateways sent, read with its KV capacity from the engine's vLLM /metrics every
--load-interval s. jsq: fewest outstanding requests; round-robin; least-kv: fewest context tokens (no
prediction); p2c: TetriInfer's power of two with KV
room; aladdin: Aladdin's best fit (the fullest engine that still meets the KV, batch and, with
--latency-profile, TTFT/ATGT limits); lengthwise: the same limits, least loaded first, for replicas that
cannot be numbered; lengthwise-pack: best fit, engines with a prompt still to prefill tried last, and with
--replicas/--replica-index each replica's own share of the engines first (fewer engines in a decode pool
with long contexts). Without a fresh report (or before any engine reported its KV
capacity) aladdin/lengthwise/lengthwise-pack/least-kv/p2c decide by JSQ, counted in
lengthwise_gateway_placement_fallbacks_total{reason}; the core's counters are
lengthwise_gateway_placement_events_total{placement,event}. Prompt tokens are counted with the tokenizer
of a local --model directory, else estimated as characters / 4.

who may call: with --api-key/--api-key-file/LENGTHWISE_API_KEY every request needs 'Authorization: Bearer KEY'
(401 otherwise; /health and /metrics open unless --protect-health). Engines started here listen on loopback with a
random key of their own. Past --max-outstanding requests in flight a request gets 429 with Retry-After at once.
/health: ok, or degraded with reasons (no engine, sidecar down); HTTP 503 only when no engine can serve.

several models (--models FILE): a request is placed only on the engines that serve the model it names; a model
whose engines are all down gets 503 while the others keep serving; /v1/models lists every served name (an
adapter's card names its parent); an unknown model gets 404 with the served names. Each name's lengths come from
its 'predictor': 'sidecar' (default; its own predictor_url or --predictor-url, asked with the name), a registry URI
that sidecar must serve, 'profile' (the mean of the name's own answers, SeaLLM's profile) or 'none'; each sidecar
is checked per name at start. 'priority': lower runs first inside an engine. 'on_engines': which of its base's
engines started here serve a name (a placement plan: an adapter loaded only there). Example catalogue:
  models:
    - {name: smol, model: ./SmolLM2-135M-Instruct, engine_args: ["--max-model-len 2048"],
       slo: {ttft_ms: 2000, tpot_ms: 150}}
    - {name: smol-terse, adapter_of: smol, adapter: ./adapters/terse, predictor: profile, priority: -1}
    - {name: llama-8b, engine_urls: ["http://10.0.0.7:8001"], slo: {ttft_ms: 500, tpot_ms: 50},
       predictor: "models:/length-llama-8b@champion", predictor_url: "http://10.0.0.7:8100"}

endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics
"""


_FLAGS: dict[str, str] = {}  # settings field -> its flag, as _setting adds them: error messages name the flag


def _setting(group: argparse._ActionsContainer, flag: str, name: str, **kw: Any) -> None:
    """Add ``flag``, which sets the settings field ``name``: its default, and the type of its value, are the field's."""
    field = GatewaySettings.model_fields[name]
    kw.setdefault("default", field.get_default(call_default_factory=True))
    if kw.get("action") in (None, "append"):
        kw.setdefault("type", _value_type(field.annotation))
    group.add_argument(flag, dest=name, **kw)
    _FLAGS[name] = flag


def _value_type(annotation: Any) -> type | None:
    """How argparse reads one value of a field annotated so (a list's: each item; ``X | None``: X); None: a string."""
    if get_origin(annotation) in (list, Union, UnionType):
        annotation = next(t for t in get_args(annotation) if t is not type(None))
    return annotation if annotation in (int, float, Path) else None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible gateway over vLLM engines that schedule by predicted response length",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Start N vLLM engines with the lengthwise scheduler plug-in (or attach to running ones) and serve an "
                    "OpenAI-compatible API in front of them. Each request gets a predicted length from the sidecar and an "
                    "SLO deadline, both passed to the engine's scheduler in vllm_xargs; engines are chosen by load; a "
                    "request an engine dropped before answering is retried on another.")
    _engine_flags(p.add_argument_group("engines"))
    _placement_flags(p.add_argument_group("placement (which engine gets a request; see 'placement' below)"))
    _prediction_flags(p.add_argument_group("prediction and SLO"))
    _gateway_flags(p.add_argument_group("gateway"))
    _security_flags(p.add_argument_group("who may call what (keys are never printed or logged)"))
    _limit_flags(p.add_argument_group("limits (what one client, or all of them, may ask)"))
    _backend_flags(p.add_argument_group("backend (this process, or a Ray Serve application for more than one machine)"))
    p.set_defaults(func=run)
    return p


BACKEND_FLAGS = ("backend", "ray_address", "ray_predictor_model")
"""The flags that choose what serves (this process, or a Ray Serve application) rather than set the gateway's settings:
the only ``serve`` flags without a :class:`GatewaySettings` field."""


def _backend_flags(b: argparse._ActionsContainer) -> None:
    b.add_argument("--backend", choices=["http", "ray"], default="http",
                   help="http: this process is the gateway over engine processes (default); ray: deploy the engines (one "
                        "replica per --engines, routed by --placement), the gateway's request steps and the sidecar as a "
                        "Ray Serve application and serve it on --host/--port (see docs/ray.md)")
    b.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="--backend ray: the Ray cluster to deploy on, e.g. ray://head:10001 or auto (default: start a "
                        "local one)")
    b.add_argument("--ray-predictor-model", metavar="URI_OR_DIR", default=None,
                   help="--backend ray: deploy the predictor sidecar in the application with this model (models:/NAME@ALIAS "
                        "or a package directory); otherwise --predictor-url, if any, is used")


def _engine_flags(e: argparse._ActionsContainer) -> None:
    _setting(e, "--model", "model", metavar="PATH_OR_NAME",
             help="model the engines serve (required unless --engine-url); a local directory also gives the gateway "
                  "the tokenizer it counts prompt tokens with")
    _setting(e, "--engine-url", "engine_urls", action="append", metavar="URL",
             help="a running vLLM OpenAI server to use; repeatable. Without it, engines are started here")
    _setting(e, "--models", "models_file", metavar="FILE",
             help="several models behind this endpoint: a YAML or TOML catalogue of served names, each with its "
                  "engines (engine_urls to attach, or model and engines to start here), its LoRA adapters (entries "
                  "with adapter_of and adapter) and its SLO (slo: {ttft_ms, tpot_ms}); see 'several models' below. "
                  "Replaces --model/--engine-url/--engines")
    _setting(e, "--prefill-url", "prefill_urls", action="append", metavar="URL",
             help="disaggregated prefill: a running vLLM server that prefills each prompt first (max_tokens 1, "
                  "kv_transfer_params for a remote decode), repeatable; the --engine-url engines then only decode, "
                  "with the KV their KV-transfer connector brings (every engine needs --kv-transfer-config). "
                  "Placement then prices the decode engines as a decode pool")
    _setting(e, "--prefill-engines", "prefill_engines", metavar="K",
             help="disaggregated prefill on this machine: start K more engines that only prefill (the --engines "
                  "ones then only decode); needs a connector on every engine, e.g. --engine-arg=\"--kv-transfer-config "
                  "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'\" (default: %(default)s)")
    _setting(e, "--engine-metrics-url", "engine_metrics_urls", action="append", metavar="URL",
             help="the scheduler plug-in's metrics endpoint of each --engine-url, in the same order (engines run "
                  "with '{\"lengthwise\": {\"metrics_port\": PORT}}' in --additional-config); re-exported on "
                  "/metrics with an engine label. Engines started here get one automatically")
    _setting(e, "--engines", "engines", metavar="N", help="engines to start (default: %(default)s)")
    _setting(e, "--policy", "policy",
             help=f"scheduling policy of the engines started here: {policy_help()} (default: %(default)s)")
    _setting(e, "--scheduler-config", "scheduler_config", default="{}", metavar="JSON",
             help="more plug-in settings for the engines started here, e.g. '{\"knobs\": {\"padding\": 0.2}, "
                  "\"default_pred_len\": 128}'")
    _setting(e, "--engine-arg", "engine_args", action="append", metavar="ARGS",
             help="extra vLLM arguments for each engine started here, repeatable, e.g. --engine-arg=--enforce-eager "
                  "--engine-arg=\"--max-num-seqs 64\"")
    _setting(e, "--engine-log-dir", "engine_log_dir", metavar="DIR", help="engine logs (default: a new temporary directory)")
    _setting(e, "--engine-start-timeout", "engine_start_timeout_s", metavar="S",
             help="seconds engines may take to become healthy (default: %(default)s)")
    _setting(e, "--engine-start-retries", "engine_start_retries", metavar="N",
             help="an engine started here that is still not healthy after --engine-start-timeout is stopped and "
                  "started again, up to N times; an engine that exits during start-up is not (default: %(default)s)")
    _setting(e, "--engine-restarts", "engine_restarts", metavar="N",
             help="an engine started here that exits while serving (its engine core crashed, the OOM killer) is started "
                  "again on new ports, its log continued, after a back-off of 1 s that doubles with each restart; at "
                  "most N restarts within --engine-restart-window, then it stays down and /health says why; the "
                  "requests it held are retried on another engine where nothing was sent yet (default: %(default)s)")
    _setting(e, "--engine-restart-window", "engine_restart_window_s", metavar="S",
             help="the window of --engine-restarts (default: %(default)s)")
    _setting(e, "--restart-wait", "restart_wait_s", metavar="S",
             help="a request that has sent its client nothing and finds no engine up waits up to S seconds for one that "
                  "is starting again after it exited (engines started here), instead of a 503 at once; it holds its "
                  "place in flight meanwhile (default: %(default)s)")
    _setting(e, "--no-pin-engines", "pin_engines", action="store_false",
             help="CPU engines started side by side share every core: by default each whole engine (API server, engine "
                  "core, worker) runs on its own cores, so one engine's busy-waiting engine core does not take the "
                  "cores another engine computes on")
    _setting(e, "--engine-malloc", "engine_malloc", choices=("tcmalloc", "system"),
             help="the allocator CPU engines started here run with: 'tcmalloc' preloads the system's tcmalloc where it "
                  "is installed (apt install libtcmalloc-minimal4), as vLLM's CPU platform intends; its model worker "
                  "grows less than on glibc's malloc in a long run (default: %(default)s); 'system': glibc's malloc")


def _placement_flags(pl: argparse._ActionsContainer) -> None:
    _setting(pl, "--placement", "placement", metavar="NAME",
             help="round-robin, jsq (alias least-outstanding), least-kv, p2c, aladdin, lengthwise-pack or lengthwise "
                  "(default: %(default)s)")
    _setting(pl, "--engine-max-num-seqs", "engine_max_num_seqs", metavar="N",
             help="the engines' --max-num-seqs: placement's batch limit (default: the --engine-arg value for "
                  "engines started here, else 256)")
    _setting(pl, "--latency-profile", "latency_profile", metavar="CSV",
             help="a step profile (step_profile.csv of 'lengthwise bench engine') fitted into the latency model of "
                  "aladdin/lengthwise/lengthwise-pack: adds the TTFT and ATGT limits (default: none, only KV and batch limits)")
    _setting(pl, "--slo-ttft-ms", "slo_ttft_ms", metavar="MS",
             help="placement's TTFT target with --latency-profile (default: slo-scale x t-p)")
    _setting(pl, "--slo-tpot-ms", "slo_tpot_ms", metavar="MS",
             help="placement's ATGT (time per output token) target with --latency-profile (default: slo-scale x t-g)")
    _setting(pl, "--load-interval", "load_interval_s", metavar="S",
             help="seconds between reads of each engine's vLLM /metrics (running, waiting, KV); a read older than "
                  "3 intervals makes aladdin/lengthwise/lengthwise-pack/p2c decide by JSQ (default: %(default)s)")
    _setting(pl, "--replicas", "replicas", metavar="G",
             help="gateway replicas sharing these engines; with lengthwise-pack each replica fills its own share "
                  "of the engines first (the i-th --engine-url for i %% G == --replica-index), so replicas do not "
                  "all pack the same engine between metrics reads, and lengthwise picks at random between the two "
                  "least loaded. Every replica must list the engines in the same order. With --backend ray: the "
                  "ingress replicas Ray Serve runs, each with its own router, numbered by Ray (default: %(default)s)")
    _setting(pl, "--replica-index", "replica_index", metavar="I",
             help="this replica's index, 0 to G-1, e.g. a StatefulSet pod's ordinal (default: %(default)s)")


def _prediction_flags(pr: argparse._ActionsContainer) -> None:
    _setting(pr, "--predictor-url", "predictor_url", metavar="URL",
             help="prediction sidecar, e.g. http://127.0.0.1:8100 (default: none)")
    _setting(pr, "--predictor-timeout-ms", "predictor_timeout_ms", help="fall back when slower (default: %(default)s)")
    _setting(pr, "--refine-at", "refine_at", type=comma_list(int, "16,64,192"), metavar="TOKENS",
             help="refine a running request's prediction when its answer reaches these lengths, e.g. 16,64,192: the "
                  "sidecar reads the answer so far (a version trained on answers so far: python -m "
                  "serving.bench.predictor.remaining) and the engine's plug-in takes what it predicts is left. "
                  "Late ones are skipped and counted (default: off)")
    _setting(pr, "--refine-timeout-ms", "refine_timeout_ms",
             help="skip a refinement the sidecar has not answered by then (default: %(default)s)")
    _setting(pr, "--no-refine-unary", "refine_unary", action="store_false",
             help="refine streamed requests only: send non-streamed ones as the client did (by default they are read "
                  "from the engine as a stream and answered whole)")
    _setting(pr, "--refine-window-ms", "refine_window_ms",
             help="gather refinements this long and send them to the sidecar, and to each engine, in one call: "
                  "fewer calls under load, for at most this much delay (default: %(default)s)")
    _setting(pr, "--refine-max-inflight", "refine_max_inflight",
             help="refinements in flight at once; more are skipped (default: %(default)s)")
    _setting(pr, "--fallback-tokens", "fallback_tokens",
             help="predicted length without a prediction, clamped to max_tokens (default: %(default)s)")
    _setting(pr, "--no-feedback", "feedback", action="store_false",
             help="do not post actual lengths to the sidecar's /v1/feedback")
    _setting(pr, "--trust-client-predictions", "trust_client_predictions", action="store_true",
             help="a request's x-lengthwise-pred-len header (output tokens) replaces the sidecar's prediction: for a "
                  "router in front that already predicted, and for benchmarks that control prediction quality. "
                  "Only behind a trusted client: a low number moves a request up every length-ordered queue")
    _setting(pr, "--allow-predictor-for-other-model", "allow_predictor_for_other_model", action="store_true",
             help="schedule by a predictor whose target model is not the served model (its predictions are counted in "
                  "lengthwise_gateway_predictions_for_other_model_total and /health says so) instead of refusing to "
                  "start; better: train one on the served model's lengths with 'lengthwise relabel'")
    _setting(pr, "--predictor-check-interval", "predictor_check_interval_s", metavar="S",
             help="seconds between checks of the sidecar's target model, so a sidecar down at start or a moved alias "
                  "is judged when it answers (default: %(default)s)")
    _setting(pr, "--slo-scale", "slo_scale", help="JCT SLO multiplier (default: the policy config's, %(default)s)")
    _setting(pr, "--slo-kind", "slo_kind", choices=["jct", "ttft+tpot", "normalised"],
             help="the SLO the engines started here optimise (the posterior policies read it): jct (EcoServe's "
                  "deadline), ttft+tpot (first token within --slo-ttft-ms, then every token within --slo-tpot-ms, as "
                  "vllm bench serve --goodput counts) or normalised (SeaLLM's latency per token); sets knobs.slo_kind "
                  "(and knobs.ttft_s) in the plug-in's settings unless --scheduler-config sets them (default: %(default)s)")
    _setting(pr, "--t-p", "t_p_s", metavar="S",
             help="prefill time of a lone request, seconds (default: %(default)s)")
    _setting(pr, "--t-g", "t_g_s", metavar="S",
             help="decode time per token of a lone request, seconds (default: %(default)s)")


def _gateway_flags(g: argparse._ActionsContainer) -> None:
    _setting(g, "--host", "host", help="listen address (default: %(default)s)")
    _setting(g, "--port", "port", help="listen port (default: %(default)s)")
    _setting(g, "--max-attempts", "max_attempts", help="engines one request may try (default: %(default)s)")
    _setting(g, "--transient-retries", "transient_retries", metavar="N",
             help="once every engine was tried, N more tries on an engine that failed the request only as a live "
                  "engine can (connect timeout, connection dropped or reset before any answer) and passes a "
                  "health probe now, after 0.5 s, then 1 s, ... (default: %(default)s)")
    _setting(g, "--connect-timeout", "connect_timeout_s", metavar="S",
             help="TCP connect timeout to an engine; raise it where engines share starved cores (default: %(default)s)")
    _setting(g, "--engine-timeout", "engine_timeout_s", metavar="S",
             help="longest wait for an answer, or for the next chunk of a stream (default: %(default)s)")
    _setting(g, "--health-interval", "health_interval_s", metavar="S", help="engine probe interval (default: %(default)s)")
    _setting(g, "--health-timeout", "health_timeout_s", metavar="S",
             help="a probe slower than this fails; two failures in a row take an engine out, unless its answers "
                  "kept arriving while the probes failed (busy, not hung) (default: %(default)s)")
    _setting(g, "--timeout-keep-alive", "client_keepalive_s", metavar="S",
             help="seconds an idle client connection stays open (as uvicorn's flag); keep it above the idle timeout of "
                  "your clients (httpx and the OpenAI SDK: 5 s) and load balancer, so that they close first: a server "
                  "that closes a connection as a client reuses it makes that request fail (default: %(default)s)")
    _setting(g, "--client-header-timeout", "client_header_timeout_s", metavar="S",
             help="a request's line and headers must arrive within S seconds of its first byte, else 408 and the "
                  "connection is closed (slowloris) (default: %(default)s)")
    _setting(g, "--client-body-timeout", "client_body_timeout_s", metavar="S",
             help="a request's whole body must arrive within S seconds of its headers, else 408 and the connection is "
                  "closed (default: %(default)s)")
    _setting(g, "--client-stall-timeout", "client_stall_timeout_s", metavar="S",
             help="a streamed answer whose client takes none of it for S seconds is cut: its engine request is "
                  "cancelled, its places freed, its connection aborted (default: %(default)s)")
    _setting(g, "--shutdown-grace", "shutdown_grace_s", metavar="S",
             help="on SIGTERM the gateway stops accepting, lets the requests in flight finish for up to S seconds, "
                  "then exits; keep it below your orchestrator's own grace period (default: %(default)s)")
    _setting(g, "--crash-quarantine", "crash_quarantine_s", metavar="S",
             help="a request on two engines when they died is sent again only alone among such suspects; if its engine "
                  "dies then, it (and, after two such, its kind: the names of its unusual options) is refused with a "
                  "400 for S seconds, so that a request that crashes engines cannot crash them again and again; "
                  "0: never (default: %(default)s)")
    _setting(g, "--allow-prompt-logprobs-with-lora", "allow_prompt_logprobs_with_lora", action="store_true",
             help="forward prompt logprobs (prompt_logprobs, or echo with logprobs) to engines serving LoRA adapters; "
                  "vLLM 0.32's engine core dies on them beside another request unless its scheduler runs such a step "
                  "alone, as the lengthwise plug-in does. Default: a 400 that says so")
    _setting(g, "--log-level", "log_level", choices=["debug", "info", "warning", "error"])
    _setting(g, "--log-prompts", "log_prompts", action="store_true",
             help="log each request's prompt text (default: no prompt text in any gateway log line)")


def _security_flags(a: argparse._ActionsContainer) -> None:
    _setting(a, "--api-key", "api_keys", action="append", metavar="KEY",
             help="a key clients must send as 'Authorization: Bearer KEY' (as vllm serve --api-key), repeatable; a "
                  "wrong or missing key gets 401. Prefer --api-key-file or LENGTHWISE_API_KEY: a flag shows in ps. "
                  "Default: none, the gateway is open")
    _setting(a, "--api-key-file", "api_key_file", metavar="PATH",
             help="more keys, one per line (# comments and blank lines skipped); read at start")
    _setting(a, "--protect-health", "protect_health", action="store_true",
             help="/health and /metrics need a key too (default: open, for load balancers and Prometheus; an open "
                  "/health names no engine address unless the caller sends a key)")
    _setting(a, "--slo-key-file", "slo_key_file", metavar="PATH",
             help="keys whose requests may set their own SLO with x-slo-ttft-ms / x-slo-tpot-ms, one per line (they "
                  "are client keys too). With client keys, any other key's x-slo-* headers are ignored and counted: "
                  "a tight SLO moves a request ahead of every other, so urgency is the operator's to grant. Without "
                  "keys every client's headers count, within --slo-min-ms and --slo-max-ms")
    _setting(a, "--engine-api-key", "engine_api_key", metavar="KEY",
             help="the key the engines want (their vllm serve --api-key), sent on every engine call; also "
                  "LENGTHWISE_ENGINE_API_KEY. Engines started here get this one, else a random one")
    _setting(a, "--no-engine-key", "random_engine_key", action="store_false",
             help="engines started here run without a key (they still listen on loopback only): for tools that send "
                  "them requests directly")
    _setting(a, "--predictor-token", "predictor_token", metavar="TOKEN",
             help="sent as 'Authorization: Bearer TOKEN' on every call to the sidecar; also LENGTHWISE_PREDICTOR_TOKEN")


def _limit_flags(lim: argparse._ActionsContainer) -> None:
    _setting(lim, "--max-outstanding", "max_outstanding", metavar="N",
             help="requests in flight in the gateway; one more gets 429 with Retry-After at once (default: "
                  "--max-outstanding-per-engine x engines)")
    _setting(lim, "--max-outstanding-per-engine", "max_outstanding_per_engine", metavar="N",
             help="requests in flight on one engine; placement skips an engine at it, and when every engine is, "
                  "the request gets 429 (default: 2 x the engines' --max-num-seqs, 256 when not known: one batch "
                  "running and one waiting for the scheduler to order)")
    _setting(lim, "--max-outstanding-per-key", "max_outstanding_per_key", metavar="N|SHARE",
             help="with client keys, the places in flight one key may hold: a count (1 or more) or, below 1, a share of "
                  "--max-outstanding; one more from that key gets 429 saying it is its key's share, while other keys "
                  "are still served. Default: half with two keys or more; no bound with one key (one client) or none")
    _setting(lim, "--engine-bound", "engine_bound", choices=["static", "slo"],
             help="static: every engine's bound is --max-outstanding-per-engine. slo: each engine's bound is learnt "
                  "from the SLO its answers meet (--slo-ttft-ms, --slo-tpot-ms): it starts at the engines' "
                  "--max-num-seqs, is cut when answers that lived near it miss, raised while they meet it, and never "
                  "passes --max-outstanding-per-engine; for engines whose batch outruns the per-token target before "
                  "it fills (default: %(default)s)")
    _setting(lim, "--engine-bound-checkpoint", "engine_bound_checkpoint", metavar="TOKENS",
             help="with --engine-bound slo: a stream whose tokens so far already miss the SLO at this many later "
                  "tokens counts as a miss at once, seconds before its end (the bound then stops admitting into a "
                  "batch that is already too slow); 0 judges every answer at its end (default: %(default)s)")
    _setting(lim, "--max-n", "max_n", metavar="N", help="the largest n a request may ask for; more is a 400 "
             "(default: %(default)s)")
    _setting(lim, "--slo-min-ms", "slo_min_ms", metavar="MS",
             help="x-slo-ttft-ms / x-slo-tpot-ms below this are raised to it (counted) (default: %(default)s)")
    _setting(lim, "--slo-max-ms", "slo_max_ms", metavar="MS",
             help="x-slo-ttft-ms / x-slo-tpot-ms above this are lowered to it (counted) (default: %(default)s)")


class UsageError(ValueError):
    pass


class _Stop(BaseException):
    """SIGTERM or SIGINT: stop serving, stop the engines, exit 0."""


def settings_from_args(a: argparse.Namespace) -> GatewaySettings:
    """Build and validate the settings; a bad value becomes one readable line."""
    try:
        sched = json.loads(a.scheduler_config)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--scheduler-config is not valid JSON ({exc.msg}), "
                         "e.g. '{\"knobs\": {\"padding\": 0.2}}'") from None
    if not isinstance(sched, dict):
        raise UsageError("--scheduler-config must be a JSON object")
    fields = {name: getattr(a, name) for name in _FLAGS}  # every flag sets its field
    fields["scheduler_config"] = sched
    if os.environ.get(KEY_ENV, "").strip():
        fields["api_keys"] = [*(fields["api_keys"] or []), os.environ[KEY_ENV].strip()]
    for name, env in (("engine_api_key", "LENGTHWISE_ENGINE_API_KEY"), ("predictor_token", "LENGTHWISE_PREDICTOR_TOKEN")):
        if fields[name] is None and os.environ.get(env):
            fields[name] = os.environ[env]
    try:
        settings = GatewaySettings(**fields)
    except ValidationError as exc:
        raise UsageError(flag_error(exc, _FLAGS)) from None

    for flag, path in (("--api-key-file", settings.api_key_file), ("--slo-key-file", settings.slo_key_file)):
        try:
            if path is not None:
                read_key_file(path)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    _check_placement(settings)
    return settings


def _check_placement(settings: GatewaySettings) -> None:
    """The latency profile fits and the engine arguments placement reads are numbers: now, not at the first request."""
    from serving.perf.latency import LatencyError

    try:
        settings.placement_config()
    except LatencyError as exc:
        raise UsageError(f"--latency-profile: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"--engine-arg: --max-num-seqs and --max-num-batched-tokens must be integers ({exc})") from None


def _check_predictor(settings: GatewaySettings) -> TargetCheck:
    """Which model the sidecar's predictor is for, against the served one (:mod:`serving.gateway.target`): another
    model's is a UsageError unless allowed; any other verdict is logged and returned for the gateway to keep."""
    import httpx

    from serving.gateway.target import TargetCheck, announce, check, refusal, served_model

    if settings.catalogue is not None:
        return TargetCheck("unchecked", None, detail="with --models each name is checked on its own (/health models)")

    async def ask() -> TargetCheck:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=settings.sidecar_headers()) as client:
            return await check(settings.predictor_url, served_model(settings), client)

    found = asyncio.run(ask())
    if found.state == "mismatch" and not settings.allow_predictor_for_other_model:
        raise UsageError(refusal(found, settings.predictor_url))
    if settings.predictor_url:
        announce(found, settings.allow_predictor_for_other_model)
    return found


def _check_model_predictors(settings: GatewaySettings) -> dict[str, TargetCheck]:
    """With a catalogue, each sidecar-predicted name's verdict (:mod:`serving.gateway.model_predictors`): a sidecar not
    for its name is a UsageError naming the entry unless allowed; the rest is logged and returned for the gateway."""
    import httpx

    from serving.gateway.model_predictors import check_entries, entry_refusal, identities
    from serving.gateway.target import announce

    cat = settings.catalogue
    if cat is None:
        return {}

    async def ask() -> dict[str, TargetCheck]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=settings.sidecar_headers()) as client:
            return await check_entries(cat, settings, identities(cat, settings), client)

    found = asyncio.run(ask())
    for name, verdict in found.items():
        entry = cat.entry(name)
        assert entry is not None
        if verdict.state == "mismatch" and not settings.allow_predictor_for_other_model:
            raise UsageError(entry_refusal(entry, verdict, entry.predictor_url or settings.predictor_url))
        announce(verdict, settings.allow_predictor_for_other_model)
    return found


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _check_engine(settings: GatewaySettings) -> None:
    """What would otherwise fail only after minutes of engine start-up: the policy, its settings, vLLM, the model."""
    if not settings.starts_engines:
        return

    try:
        sched = SchedulerSettings.model_validate({"policy": settings.policy, **settings.scheduler_config})
        make_policy(sched.policy, PolicyConfig(**sched.knobs), 64)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UsageError(f"--scheduler-config {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    except (PolicyError, ValueError) as exc:
        raise UsageError(f"--policy: {exc}") from None
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise UsageError("vLLM is not installed here, so no engine can be started; install the cpu or gpu extra, "
                             "or attach to running engines with --engine-url")
    except (ImportError, ValueError):
        raise UsageError("vLLM is not importable here; attach to running engines with --engine-url") from None
    for group in settings.engine_groups():
        name, flag = str(group.model), "--model" if settings.catalogue is None else f"--models: 'model' {group.model!r}"
        model = Path(name)
        if (name.startswith((".", "/", "~")) or model.exists()) and not (model.expanduser() / "config.json").exists():
            raise UsageError(f"{flag}: no config.json there (a Hugging Face model directory is needed)")


def _resolve(urls: list[str], flag: str = "--engine-url") -> None:
    """A host name that does not resolve is a typo, not an engine still starting: fail now rather than after the timeout."""
    for url in urls:
        parts = urlsplit(url)
        try:
            socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except (OSError, UnicodeError, ValueError) as exc:
            raise UsageError(f"{flag} {url}: cannot resolve {parts.hostname!r} "
                             f"({getattr(exc, 'strerror', None) or exc})") from None


def _attach(urls: list[str], timeout_s: float, prefill: bool = False, flag: str | None = None) -> None:
    """Engines given by URL (``--engine-url``, or ``--prefill-url`` with ``prefill``; ``flag`` names where else they were
    given): their hosts resolve and at least one answers /health."""
    from serving.launch.engines import EngineStartError, wait_healthy

    given, what = ("--prefill-url", "prefill engine") if prefill else ("--engine-url", "engine")
    flag = flag or given
    _resolve(urls, flag)
    try:
        wait_healthy(urls, timeout_s, require_all=False, prefill=prefill)
    except EngineStartError:
        raise UsageError(f"{flag}: no {what} answered /health within {timeout_s:g} s ({', '.join(urls)}); start them "
                         "first or raise --engine-start-timeout") from None


def _catalogue_engines(settings: GatewaySettings, procs: list) -> tuple[list[str], dict[str, list[str]]]:
    """The ``--models`` engines: those of entries with ``model`` started here (all at once, the cores shared out), those
    with ``engine_urls`` attached; then every engine must list the names its entry gives it (a base and its adapters),
    or nothing would ever be placed on it. Returns the engine URLs and the names each is placed (its entry's, or
    its ``on_engines`` share of them); the processes started here go into the caller's
    ``procs`` before anything can fail, so the caller stops them whatever happens next."""
    from serving.launch.engines import start_engines, wait_started

    cat = settings.catalogue
    assert cat is not None
    groups = settings.engine_groups()
    if groups:
        log_dir = settings.engine_log_dir or Path(tempfile.mkdtemp(prefix="lengthwise-engines-"))
        procs.extend(start_engines(settings, log_dir, groups))
        log.info("starting %d engine(s) for %s with policy %s; logs in %s", len(procs),
                 ", ".join(str(g.model) for g in groups), settings.policy, log_dir)
        wait_started(procs, settings.engine_start_timeout_s, settings.engine_start_retries)
    started = iter(procs)
    urls: list[str] = []
    serves: dict[str, list[str]] = {}  # engine URL -> the names its entry says it serves
    for m in cat.models:
        if m.is_adapter:
            continue
        mine = [next(started).url for _ in range(m.engines)] if m.starts_engines else m.engine_urls
        per_engine = cat.engine_names(m.name)
        serves.update({u: per_engine[i if m.starts_engines else 0] for i, u in enumerate(mine)})
        urls += mine
    if attached := cat.attached_urls():
        _attach(attached, settings.engine_start_timeout_s, flag="--models engine_urls")
    _check_served_names(settings, serves)
    return urls, serves


def _check_served_names(settings: GatewaySettings, serves: dict[str, list[str]]) -> None:
    """Every engine that answers lists the names its catalogue entry gives it (UsageError naming the engine, what it
    lists and the fix); one that does not answer yet is checked by the gateway when it comes up."""
    import httpx

    from serving.gateway.pool import engine_auth

    with httpx.Client(timeout=10.0, headers=engine_auth(settings)) as client:
        for url, names in serves.items():
            try:
                listed = {card["id"] for card in client.get(url + "/v1/models").raise_for_status().json()["data"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
            missing = [n for n in names if n not in listed]
            if missing:
                raise UsageError(f"--models: the engine {url} does not serve {', '.join(map(repr, missing))} (it lists "
                                 f"{', '.join(sorted(listed))}); start it with --served-model-name {names[0]} (and "
                                 "--lora-modules for adapters), or name the entry as it lists")


def run(a: argparse.Namespace, backends: Mapping[str, Callable[[GatewaySettings, argparse.Namespace], int]] | None = None) -> int:
    """Start engines (or check the attached ones), then serve until SIGINT/SIGTERM; engines stop with us. ``backends``:
    what serves ``--backend NAME`` other than ``http`` (given the checked settings and the arguments)."""
    from serving.launch.engines import EngineStartError, start_engines, stop_engines, wait_started

    try:
        settings = settings_from_args(a)
        _check_engine(settings)
    except UsageError as exc:
        print(f"lengthwise serve: error: {exc}", file=sys.stderr)
        return 2
    backend = getattr(a, "backend", "http")
    if backend != "http":
        # another backend sits above the gateway (the Ray one reuses its request steps), so the gateway imports nothing
        # of it: the top-level CLI hands it in (serving/cli.py)
        serve_other = (backends or {}).get(backend)
        if serve_other is None:
            print(f"lengthwise serve: error: --backend {backend} is not available in this command", file=sys.stderr)
            return 2
        return serve_other(settings, a)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)  # its debug lines are per-connection noise
    try:
        target = _check_predictor(settings)  # before minutes of engine start-up: a predictor for another model fails now
        model_targets = _check_model_predictors(settings)
    except UsageError as exc:
        print(f"lengthwise serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _listen(settings.host, settings.port)  # before minutes of engine start-up: a busy port fails now
    except (OSError, OverflowError) as exc:
        print(f"lengthwise serve: error: cannot listen on {settings.host}:{settings.port}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2

    def _stop(signum, frame):  # while engines start, or re-raised by uvicorn after its graceful shutdown
        raise _Stop(signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    procs = []
    try:
        if settings.starts_engines and settings.engine_api_key is None and settings.random_engine_key:
            from pydantic import SecretStr

            # hex: a key an operator copies into a flag never starts with "-" (a url-safe one does 1 time in 64, and
            # "--engine-api-key -x..." then reads as a missing value)
            settings = settings.model_copy(update={"engine_api_key": SecretStr(secrets.token_hex(32))})
        serves: dict[str, list[str]] | None = None  # engine URL -> the names placed on it (a catalogue's)
        if settings.catalogue is not None:
            urls, serves = _catalogue_engines(settings, procs)
            prefill_urls, plugin_metrics = [], {p.url: p.metrics_url for p in procs if p.metrics_url}
        elif settings.starts_engines:
            log_dir = settings.engine_log_dir or Path(tempfile.mkdtemp(prefix="lengthwise-engines-"))
            procs = start_engines(settings, log_dir)
            log.info("starting %d engine(s)%s with policy %s; logs in %s", settings.engines,
                     f" and {settings.prefill_engines} prefill engine(s)" if settings.prefill_engines else "",
                     settings.policy, log_dir)
            wait_started(procs, settings.engine_start_timeout_s, settings.engine_start_retries)  # may start some again
            urls = [p.url for p in procs[:settings.engines]]
            prefill_urls = [p.url for p in procs[settings.engines:]]
            plugin_metrics = {p.url: p.metrics_url for p in procs if p.metrics_url}
        else:
            urls, prefill_urls = settings.engine_urls, settings.prefill_urls
            plugin_metrics = dict(zip(urls, settings.engine_metrics_urls))
            _attach(urls, settings.engine_start_timeout_s)
            if prefill_urls:
                _attach(prefill_urls, settings.engine_start_timeout_s, prefill=True)
        if target.pending:  # the sidecar was not up or still loading: it may be by now
            target = _check_predictor(settings)
        if any(t.pending for t in model_targets.values()):
            model_targets = _check_model_predictors(settings)
        import uvicorn

        from serving.gateway.app import create_app

        app = create_app(settings, urls, plugin_metrics, prefill_urls, target, model_targets, serves, procs or None)
        from serving.gateway.slow_clients import guarded_protocol

        refused = app.state.metrics.rejected
        config = uvicorn.Config(app, log_level=settings.log_level, access_log=False,
                                timeout_graceful_shutdown=settings.shutdown_grace_s,
                                timeout_keep_alive=settings.client_keepalive_s,
                                http=guarded_protocol(settings.client_header_timeout_s, lambda why: refused.labels(why).inc()))
        log.info("lengthwise gateway on http://%s:%d over %s", settings.host, sock.getsockname()[1], ", ".join(urls))
        uvicorn.Server(config).run(sockets=[sock])
        return 0
    except EngineStartError as exc:
        print(f"lengthwise serve: error: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:  # attached engines that cannot be reached: a configuration mistake
        print(f"lengthwise serve: error: {exc}", file=sys.stderr)
        return 2
    except (_Stop, KeyboardInterrupt):
        return 0  # a requested stop: the engines are stopped below, so this is a clean exit
    finally:
        if procs:
            log.info("stopping %d engine(s)", len(procs))
            stop_engines(procs)
