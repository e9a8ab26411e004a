"""Every setting of ``lengthwise serve`` in one pydantic model (the CLI builds it; tests and embedders can too)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from serving.argtypes import http_url
from serving.gateway.auth import read_key_file
from serving.gateway.catalogue import Catalogue, CatalogueError, read_catalogue
from serving.launch.engines import engine_args, flag_value
from serving.policy.config import PolicyConfig

if TYPE_CHECKING:
    from serving.gateway.placement import PlacementConfig

# EcoServe's JCT SLO (§4) as the simulator uses it: slo_scale x (t_p + t_g x RL). The defaults for t_p and t_g are
# the simulator's isolated prefill and decode times of its llama8b-a100 scenario (Llama-3.1-8B on an A100, BLIS
# coefficients); an operator measures their own with one request running alone.
DEFAULT_T_P_S = 0.033
DEFAULT_T_G_S = 0.0165
DEFAULT_MAX_NUM_SEQS = 256  # what placement assumes of an engine whose --max-num-seqs it is not told
OUTSTANDING_PER_SEQ = 2  # requests in flight per engine batch slot before 429 (see GatewaySettings.outstanding_bounds)
KEY_SHARE = 0.5  # of the places in flight, what one client key may hold by default (see GatewaySettings.key_share)


class GatewaySettings(BaseModel):
    """What the gateway does and where its engines and predictor are."""

    model_config = ConfigDict(extra="forbid")

    # engines
    model: str | None = Field(None, description="model path or name the engines serve (required to start engines)")
    models_file: Path | None = Field(None, description="the model catalogue (YAML or TOML, serving/gateway/catalogue.py): "
                                     "several models and LoRA adapters behind one endpoint, each with its engines and "
                                     "SLO, instead of model/engine_urls/engines")
    engine_urls: list[str] = Field(default_factory=list, description="attach to these running vLLM OpenAI servers")
    engines: int = Field(1, ge=1, le=64, description="engines to start when no engine_urls are given")
    prefill_engines: int = Field(0, ge=0, le=64, description="disaggregated prefill with engines started here: this many "
                                 "more engines only prefill (every engine needs --kv-transfer-config in engine_args)")
    prefill_urls: list[str] = Field(default_factory=list,
                                    description="disaggregated prefill: running vLLM servers (with a KV-transfer connector) "
                                                "that prefill every prompt before engine_urls decode it")
    engine_metrics_urls: list[str] = Field(default_factory=list,
                                           description="the plug-in metrics URL of each attached engine, in engine_urls "
                                                       "order (its metrics_port); engines started here get one")
    policy: str = Field("lengthwise", min_length=1, description="scheduling policy of the plug-in in engines we start")
    scheduler_config: dict[str, Any] = Field(default_factory=dict,
                                             description="more plug-in settings (knobs, default_pred_len, tfs, log_every_s)")
    engine_args: list[str] = Field(default_factory=list, description="extra arguments for each engine we start")
    engine_log_dir: Path | None = Field(None, description="engine logs go here (default: a new temporary directory)")
    engine_start_timeout_s: float = Field(900.0, gt=0, description="how long engines may take to answer /health")
    engine_start_retries: int = Field(1, ge=0, description="how many more times an engine started here that is not "
                                      "healthy after engine_start_timeout_s is started again (one that exits is not)")
    engine_restarts: int = Field(5, ge=0, description="an engine started here that exits while serving is started "
                                 "again (new ports, its log continued), at most this many times within "
                                 "engine_restart_window_s, each after a back-off that doubles; then it stays down (0: never)")
    engine_restart_window_s: float = Field(600.0, gt=0, description="the window of the engine_restarts budget")
    restart_wait_s: float = Field(120.0, ge=0, description="a request that sent its client nothing and finds no engine "
                                  "up waits this long for one starting again after it exited, instead of a 503 at once")
    crash_quarantine_s: float = Field(600.0, ge=0, description="how long a request whose engine died while it ran on "
                                      "probation (after two deaths) is refused, and deaths are remembered "
                                      "(serving/gateway/quarantine.py); 0: never refused")
    allow_prompt_logprobs_with_lora: bool = Field(False, description="forward prompt logprobs (prompt_logprobs, or echo "
                                                  "with logprobs) to engines that serve LoRA adapters: vLLM 0.32's engine "
                                                  "core dies on them beside other requests unless its scheduler runs "
                                                  "each alone, as the lengthwise plug-in does. Default: a 400")
    pin_engines: bool = Field(True, description="CPU engines started side by side each run on their own cores: the whole "
                              "process tree (API server, engine core, worker), not only the worker's compute threads")
    engine_malloc: Literal["tcmalloc", "system"] = Field(
        "tcmalloc", description="the allocator CPU engines started here run with: tcmalloc preloaded where the system "
        "has it, as vLLM's CPU platform intends (else glibc's, said once in the log), or the system's malloc")
    placement: str = Field("jsq", description="engine choice: round-robin, jsq (alias least-outstanding), least-kv, p2c, "
                           "aladdin, lengthwise-pack, lengthwise")
    engine_max_num_seqs: int | None = Field(None, ge=1, description="the engines' --max-num-seqs, for placement's batch "
                                            "limit (default: the --engine-arg value for engines started here, else 256)")
    latency_profile: Path | None = Field(None, description="step profile CSV (lengthwise bench engine) fitted into the "
                                         "latency model of aladdin/lengthwise/lengthwise-pack placement's TTFT and ATGT limits")
    slo_ttft_ms: float | None = Field(None, gt=0, description="placement's TTFT target (default: slo_scale x t_p)")
    slo_tpot_ms: float | None = Field(None, gt=0, description="placement's ATGT target (default: slo_scale x t_g)")
    load_interval_s: float = Field(2.0, gt=0, description="seconds between reads of each engine's vLLM /metrics")
    replica_index: int = Field(0, ge=0, description="this gateway's index among the replicas sharing the engines")
    replicas: int = Field(1, ge=1, description="gateway replicas sharing the engines (lengthwise-pack gives each its "
                                                 "own share of them to fill first)")
    load_stale_after: int = Field(3, ge=1, description="a load report older than this many intervals is stale")
    shutdown_grace_s: float = Field(30.0, gt=0, description="on SIGTERM, how long the requests in flight may run to their "
                                                             "end before the gateway exits (what is left then is cut)")
    # A client's idle connection must be closed by the client first: a server that closes it at the moment the client
    # reuses it resets the request (httpx and the OpenAI SDK keep idle connections 5 s, as uvicorn's default does).
    client_keepalive_s: float = Field(75.0, gt=0, description="an idle client connection is kept open this long; keep it "
                                                               "above your clients' and load balancer's own idle timeout")
    # A client that is slow to send or to read holds a connection (and, reading, a place and an engine sequence):
    # serving/gateway/slow_clients.py
    client_header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this long "
                                           "of its first byte, else its connection is closed (408)")
    client_body_timeout_s: float = Field(30.0, gt=0, description="a request's whole body must arrive within this long "
                                         "of its headers, else 408 and its connection is closed")
    client_stall_timeout_s: float = Field(30.0, gt=0, description="a streamed answer whose client takes none of it for "
                                          "this long (the connection's buffers full) is cut: its engine request is "
                                          "cancelled and its places freed")
    health_interval_s: float = Field(1.0, gt=0, description="seconds between engine /health probes")
    health_timeout_s: float = Field(5.0, gt=0, description="a probe slower than this is a failure")
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed probes before an engine is skipped")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout to an engine")
    engine_timeout_s: float = Field(600.0, gt=0,
                                    description="longest wait for an engine's answer (non-streaming) or its next chunk "
                                                "(streaming)")
    max_attempts: int = Field(3, ge=1, description="engines one request may be sent to (each at most once)")
    transient_retries: int = Field(2, ge=0, description="once every engine was tried: more tries on an engine that failed "
                                   "the request only by a connect timeout or a connection dropped or reset before any "
                                   "answer, and passes a health probe")
    retry_backoff_s: float = Field(0.5, ge=0, description="pause before the first of those tries; it doubles for each next one")
    keepalive_s: float = Field(2.0, gt=0, description="an idle connection of the gateway's own (to an engine, the sidecar "
                                                      "or its feedback endpoint) is reused for this long: below those "
                                                      "servers' keep-alive (vLLM and the sidecar: uvicorn's 5 s)")
    # predictor
    predictor_url: str | None = Field(None, description="prediction sidecar base URL; none: every request uses the fallback")
    predictor_timeout_ms: float = Field(50.0, gt=0, description="a prediction slower than this falls back")
    fallback_tokens: int = Field(256, ge=1, description="fallback predicted length (clamped to max_tokens)")
    trust_client_predictions: bool = Field(False, description="take a client's x-lengthwise-pred-len header as the prediction "
                                                              "(an upstream router that already predicted; benchmarks)")
    feedback: bool = Field(True, description="post actual output lengths to the sidecar's /v1/feedback")
    allow_predictor_for_other_model: bool = Field(False, description="schedule by a predictor whose target model is not "
                                                  "the served model (logged, counted, shown in /health) instead of "
                                                  "refusing to start")
    refine_at: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list, description="answer lengths (tokens) at which a running request's prediction is refined: "
        "the sidecar reads the prompt and the answer so far and the request's engine gets its prediction of the tokens "
        "still to come (serving/gateway/refine.py). Needs a sidecar version trained on answers so far, and each "
        "engine's plug-in port (engines started here; attached ones: engine_metrics_urls). Empty: off")
    refine_timeout_ms: float = Field(200.0, gt=0, description="a refinement the sidecar has not answered by then is "
                                     "skipped (counted), never queued")
    refine_max_inflight: int = Field(64, ge=1, description="refinements in flight at once; one more is skipped (counted)")
    refine_window_ms: float = Field(20.0, ge=0, description="refinements bound for the sidecar, or for one engine, are "
                                    "gathered this long and sent in one call (at most 64 in one)")
    refine_unary: bool = Field(True, description="with refine_at, read a non-streamed request from its engine as a "
                               "stream and give its client the answer whole, so that it is refined too (one sequence, "
                               "no logprobs, echo or tools: serving/gateway/assemble.py)")
    predictor_check_interval_s: float = Field(30.0, gt=0, description="seconds between checks of which model the "
                                              "sidecar's predictor is for (a sidecar that was not up at start, an "
                                              "alias moved to another version)")
    # SLO
    slo_kind: Literal["jct", "ttft+tpot", "normalised"] = Field(
        "jct", description="the SLO the engines started here optimise; goes to the plug-in as knobs.slo_kind (and, for "
                           "ttft+tpot, knobs.ttft_s from the TTFT target) unless scheduler_config sets them")
    slo_scale: float = Field(PolicyConfig().slo_scale, gt=0, description="JCT SLO = slo_scale x (t_p + t_g x predicted length)")
    t_p_s: float = Field(DEFAULT_T_P_S, ge=0, description="prefill time of a request running alone, seconds")
    t_g_s: float = Field(DEFAULT_T_G_S, ge=0, description="decode time per output token of a request running alone, seconds")
    engine_api_key: SecretStr | None = Field(None, description="the bearer key the engines want (vllm serve --api-key): "
                                             "sent on every engine call; engines started here get a random one when "
                                             "none is given")
    random_engine_key: bool = Field(True, description="engines started here without an engine_api_key get a random "
                                    "one (false: they run open, for tools that talk to them directly)")
    predictor_token: SecretStr | None = Field(None, description="a bearer token sent on every call to the sidecar")
    # who may call what
    api_keys: list[SecretStr] = Field(default_factory=list, description="bearer keys a client must send (OpenAI's "
                                      "Authorization: Bearer KEY); none: the gateway is open")
    api_key_file: Path | None = Field(None, description="more keys, one per line (blank lines and # comments skipped)")
    protect_health: bool = Field(False, description="/health and /metrics need a key too (default: open, for probes "
                                 "and Prometheus)")
    slo_key_file: Path | None = Field(None, description="keys whose requests may set their own SLO (x-slo-ttft-ms, "
                                      "x-slo-tpot-ms), one per line; they are client keys too. With client keys, every "
                                      "other key's x-slo-* headers are ignored (counted); a gateway without keys "
                                      "honours everyone's, within slo_min_ms and slo_max_ms")
    log_prompts: bool = Field(False, description="log each request's prompt text (default: no prompt text in any log line)")
    # bounds on what a client may ask
    max_outstanding: int | None = Field(None, ge=1, description="requests in flight in the gateway, past which a request "
                                        "gets 429 at once (default: max_outstanding_per_engine x engines)")
    max_outstanding_per_engine: int | None = Field(None, ge=1, description="requests in flight on one engine (default: "
                                                   "2 x the engines' max_num_seqs)")
    max_outstanding_per_key: float | None = Field(None, gt=0, description="with client keys, the places in flight one "
                                                  "key may hold: a count (1 or more), or below 1 a share of "
                                                  "max_outstanding (default: half with two keys or more; no bound with "
                                                  "one key or none)")
    engine_bound: Literal["static", "slo"] = Field("static", description="each engine's bound on requests in flight: "
        "static (max_outstanding_per_engine) or slo (learnt per engine from the SLO its answers meet, at most "
        "max_outstanding_per_engine; see serving/gateway/concurrency.py)")
    engine_bound_checkpoint: int = Field(32, ge=0, description="with engine_bound slo: a stream already missing the "
                                         "SLO at this many later tokens is judged then; 0 judges every answer at its end")
    max_n: int = Field(4, ge=1, description="the largest n (sequences per prompt) a request may ask for")
    max_messages: int = Field(2048, ge=1, description="the most messages a chat request may hold (OpenAI's own limit)")
    slo_min_ms: float = Field(1.0, gt=0, description="x-slo-ttft-ms / x-slo-tpot-ms below this are raised to it")
    slo_max_ms: float = Field(600_000.0, gt=0, description="x-slo-ttft-ms / x-slo-tpot-ms above this are lowered to it")
    # gateway
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(16 << 20, ge=1024, description="larger request bodies get 413")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")
    _catalogue: Catalogue | None = PrivateAttr(None)

    @field_validator("engine_urls", "engine_metrics_urls", "prefill_urls", "predictor_url")
    @classmethod
    def _http_urls(cls, v):
        return [http_url(u) for u in v] if isinstance(v, list) else (http_url(v) if isinstance(v, str) else v)

    @field_validator("max_outstanding_per_key")
    @classmethod
    def _whole_count(cls, v: float | None) -> float | None:
        if v is not None and v > 1 and not float(v).is_integer():
            raise ValueError(f"{v:g} is neither a share (below 1) nor a count of places (a whole number)")
        return v

    @field_validator("placement")
    @classmethod
    def _known_placement(cls, v: str) -> str:
        from serving.gateway.placement import canonical_placement
        from serving.placement import PlacementError

        try:
            return canonical_placement(v)
        except PlacementError as exc:
            raise ValueError(f"{exc} (or least-outstanding, an alias of jsq)") from None

    @model_validator(mode="after")
    def _read_catalogue(self) -> GatewaySettings:
        if self.models_file is None:
            return self
        given = [flag for flag, on in (("--model", self.model), ("--engine-url", self.engine_urls),
                                       ("--engines", self.engines != 1), ("--prefill-engines", self.prefill_engines),
                                       ("--prefill-url", self.prefill_urls),
                                       ("--engine-metrics-url", self.engine_metrics_urls)) if on]
        if given:
            raise ValueError(f"--models names every model's engines in its file: drop {', '.join(given)}")
        try:
            self._catalogue = read_catalogue(self.models_file)
        except CatalogueError as exc:
            raise ValueError(f"--models {exc}") from None
        return self

    @model_validator(mode="after")
    def _engines_or_model(self) -> GatewaySettings:
        dup = sorted({u for u in self.engine_urls if self.engine_urls.count(u) > 1})
        if dup:
            raise ValueError(f"--engine-url {dup[0]} is given twice; name each engine once")
        dup = sorted({u for u in self.prefill_urls if self.prefill_urls.count(u) > 1 or u in self.engine_urls})
        if dup:
            raise ValueError(f"--prefill-url {dup[0]} is given twice, or also as an --engine-url; an engine either "
                             "prefills for the others or decodes")
        if self.prefill_urls and not self.engine_urls:
            raise ValueError("--prefill-url needs the decode engines as --engine-url; to start both kinds here, use "
                             "--prefill-engines")
        if self.prefill_engines and self.engine_urls:
            raise ValueError("--prefill-engines starts prefill engines here; with --engine-url give them as --prefill-url")
        if self.prefill_engines and self.engine_arg("--kv-transfer-config") is None:
            raise ValueError("--prefill-engines needs a KV-transfer connector on every engine, "
                             "e.g. --engine-arg=\"--kv-transfer-config "
                             "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'\"")
        if self.replica_index >= self.replicas:
            raise ValueError(f"--replica-index {self.replica_index} is not one of --replicas {self.replicas} "
                             f"(0 to {self.replicas - 1})")
        if self.latency_profile is not None:
            from serving.placement import PLACEMENTS

            limited = [name for name, cls in PLACEMENTS.items() if cls.needs_limits]  # those that plan with Aladdin's limits
            if self.placement not in limited:
                raise ValueError(f"--latency-profile is used by --placement {', '.join(limited[:-1])} or {limited[-1]} only, "
                                 f"not {self.placement}")
        if not self.engine_urls and not self.model and self.models_file is None:
            raise ValueError("give --model to start engines, or --engine-url to attach to running ones (--models for "
                             "several models)")
        if self.engine_urls and self.engines > 1:
            raise ValueError("--engines starts engines here; with --engine-url the gateway attaches to running ones instead")
        if "policy" in self.scheduler_config:
            raise ValueError("set the policy with --policy, not inside --scheduler-config")
        if self.slo_kind != "jct":  # jct is the plug-in's own default: nothing to say
            knobs = self.scheduler_config.setdefault("knobs", {})
            if not isinstance(knobs, dict):
                raise ValueError("--scheduler-config knobs must be a JSON object, e.g. '{\"knobs\": {\"padding\": 0.2}}'")
            knobs.setdefault("slo_kind", self.slo_kind)
            if self.slo_kind == "ttft+tpot":
                knobs.setdefault("ttft_s", self.slo_targets()[0])
        if self.slo_min_ms > self.slo_max_ms:
            raise ValueError(f"--slo-min-ms {self.slo_min_ms:g} is above --slo-max-ms {self.slo_max_ms:g}")
        if any(not k.get_secret_value().strip() for k in self.api_keys):
            raise ValueError("an API key is empty")
        if self.engine_metrics_urls and len(self.engine_metrics_urls) != len(self.engine_urls):
            raise ValueError(f"give one --engine-metrics-url per --engine-url, in the same order "
                             f"({len(self.engine_metrics_urls)} for {len(self.engine_urls)} engines)")
        return self

    @property
    def catalogue(self) -> Catalogue | None:
        """The ``--models`` catalogue, read and checked when the settings were built; None without one."""
        return self._catalogue

    @property
    def starts_engines(self) -> bool:
        if self._catalogue is not None:
            return any(m.starts_engines for m in self._catalogue.models)
        return not self.engine_urls

    def sidecar_headers(self) -> dict[str, str]:
        """What every call to the sidecar carries: ``--predictor-token`` as a bearer token, where one is set."""
        token = self.predictor_token
        return {"Authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}

    def engine_groups(self) -> list[GatewaySettings]:
        """The engines to start, one settings object per model that starts its own (``--models``: each base entry with
        ``model``, served under its name, its adapters loaded with ``--lora-modules``; one per run of its engines that
        load the same adapters, where ``on_engines`` lays adapters on some only); ``[self]`` without a catalogue."""
        cat = self._catalogue
        if cat is None:
            return [self]
        return [self.model_copy(update={
            "model": m.model, "engines": count, "prefill_engines": 0,
            "engine_args": [*self.engine_args, *m.engine_args, shlex.join(["--served-model-name", m.name]),
                            *([shlex.join(cat.lora_args(m.name, loaded))] if loaded else [])]})
            for m in cat.models if m.starts_engines for count, loaded in cat.engine_runs(m.name)]

    @property
    def stale_after_s(self) -> float:
        """A load report older than this is stale."""
        return self.load_stale_after * self.load_interval_s

    def client_keys(self) -> list[SecretStr]:
        """``api_keys``, those of ``api_key_file`` and of ``slo_key_file`` (ValueError naming the file, never a key,
        when one is unusable)."""
        extra = read_key_file(self.api_key_file) if self.api_key_file is not None else []
        return [*self.api_keys, *(SecretStr(k) for k in extra), *self.slo_keys()]

    def slo_keys(self) -> list[SecretStr]:
        """The keys of ``slo_key_file``: those whose x-slo-* headers are honoured."""
        return [SecretStr(k) for k in read_key_file(self.slo_key_file)] if self.slo_key_file is not None else []

    @property
    def engine_seqs(self) -> int:
        """The engines' --max-num-seqs: given, else the --engine-arg value for engines started here (with ``--models``,
        the largest of its entries' engine arguments), else 256."""
        if self.engine_max_num_seqs:
            return self.engine_max_num_seqs
        given = [int(v) for g in self.engine_groups() if (v := g.engine_arg("--max-num-seqs"))]
        return max(given) if given else int(self.engine_arg("--max-num-seqs") or DEFAULT_MAX_NUM_SEQS)

    def outstanding_bounds(self, engines: int) -> tuple[int, int]:
        """(per engine, in total): the requests in flight past which the gateway answers 429.

        Why 2 x max_num_seqs per engine by default: an engine runs max_num_seqs requests at once; as many again waiting
        give its scheduler a queue to order by predicted length, and a request past that would wait at least two full
        batches inside the engine, where a 429 lets its client (or a load balancer) try another replica now.
        """
        per = self.max_outstanding_per_engine or OUTSTANDING_PER_SEQ * self.engine_seqs
        return per, self.max_outstanding or per * max(1, engines)

    def key_share(self, limit: int, keys: int) -> int | None:
        """The places in flight, of ``limit``, that one of ``keys`` client keys may hold; None: no bound per key.

        Why half by default: a key that may hold every place can refuse every other client (16 streams from one key
        on a slow engine held all 16 places for minutes, and everyone else got 429); at half, any other key still
        finds room, and one busy client alone still gets most of the gateway. With one key or none there is no other
        client to keep room for (a shared key is one client to the gateway), so there is no bound unless one is set
        (with no key there is nothing to count by at all).
        """
        share = self.max_outstanding_per_key
        if keys == 0 or (share is None and keys < 2):
            return None
        share = KEY_SHARE if share is None else share
        return max(1, min(limit, math.ceil(share * limit) if share < 1 else int(share)))

    def slo_targets(self) -> tuple[float, float]:
        """(TTFT, ATGT) in seconds that placement and the learnt engine bound aim for: --slo-ttft-ms / --slo-tpot-ms, else
        slo_scale x t_p and slo_scale x t_g."""
        ttft = self.slo_ttft_ms / 1000 if self.slo_ttft_ms else self.slo_scale * self.t_p_s
        tpot = self.slo_tpot_ms / 1000 if self.slo_tpot_ms else self.slo_scale * self.t_g_s
        return ttft, tpot

    def engine_arg(self, flag: str) -> str | None:
        """The value of ``flag`` in the ``--engine-arg`` strings (``--flag V`` or ``--flag=V``), if given there."""
        return flag_value(engine_args(self), flag)

    def placement_config(self) -> PlacementConfig:
        """The placement's settings; loads and fits ``latency_profile`` (LatencyError when it is unusable)."""
        from serving.gateway.placement import PlacementConfig

        latency = None
        if self.latency_profile is not None:
            from serving.perf.latency import FittedLatency

            latency = FittedLatency.from_csv(self.latency_profile)
            # the decode engines only decode: a prompt's KV arrives, its compute is elsewhere
            if self.prefill_urls or self.prefill_engines:
                from serving.perf.latency import DecodePoolLatency

                latency = DecodePoolLatency(latency)
        seqs = self.engine_seqs
        chunk = int(self.engine_arg("--max-num-batched-tokens") or 2048)
        ttft, tpot = self.slo_targets()
        return PlacementConfig(self.placement, max_num_seqs=seqs, chunk_tokens=chunk, latency=latency, ttft_s=ttft,
                               atgt_s=tpot, others_pred_len=self.fallback_tokens,
                               stale_after_s=self.stale_after_s, replica=(self.replica_index, self.replicas))
