"""Every setting of ``predictor-sidecar`` in one pydantic model, defined once.

The command line derives its flags from these fields (name, type, default, help: predictor/sidecar/cli.py), and
the model validates them, so a value the CLI refuses is refused the same way when a test or an embedder builds
the settings in code. The defaults suit a small CPU machine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

DEFAULT_MODEL = "models:/length-predictor@champion"


class SidecarSettings(BaseModel):
    """What the sidecar serves, where it listens, how it batches and how it tracks online error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="models:/NAME@ALIAS (followed), models:/NAME/VERSION (pinned) or a "
                                                  "package directory")
    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8100, ge=1, le=65535, description="listen port")
    # batching and inference
    max_batch: int = Field(32, ge=1, description="prompts per forward pass")
    max_wait_ms: float = Field(2.0, ge=0, description="longest a prompt waits for others to join its batch")
    threads: int | None = Field(None, ge=1, description="onnxruntime intra-op threads per worker (default: "
                                                        "$LENGTHWISE_ORT_THREADS or min(4, cores))")
    workers: int = Field(1, ge=1, le=64, description="micro-batches run side by side, each with its own session; on 2 cores "
                                                     "--workers 2 --threads 1 gives more predictions/s under load, the "
                                                     "default lower latency for a lone request")
    # Small runs stay in cache: measured, a budget of 2048 costs about 1.5x the CPU of 256.
    token_budget: int = Field(256, ge=1, description="padded tokens per onnxruntime run; a micro-batch is split by prompt "
                                                     "length into runs this size")
    precision: Literal["fp32", "int8", "fused", "fused-int8"] = Field(
        "fp32", description="int8 quantizes the model's weights once at load (kept beside it): about 1.7x predictions/s on "
                            "a CPU at equal measured accuracy; fused runs onnxruntime's fused encoder graph (shipped by "
                            "train-predictor --optimize, else made once at load), fused-int8 that graph quantized")
    fast_tier: bool = Field(True, description="answer from the package's fast tier (TF-IDF per slice, about 1 ms) a "
                                              "prompt the encoder would answer after its caller's x-lengthwise-timeout-ms "
                                              "(judged on arrival from the queue, or still queued spill_margin_ms before "
                                              "it); --no-fast-tier drops such prompts unrun (504), as a package without "
                                              "a fast tier does")
    spill_margin_ms: float = Field(10.0, ge=0, description="how long before the caller's timeout a still-queued prompt "
                                                           "goes to the fast tier: time for it to run and the answer to "
                                                           "travel back")
    max_prompt_tokens: int | None = Field(None, ge=4, description="ablation knob: cap the prompt tokens below the budget "
                                                                  "the model was trained with (default: that budget)")
    # Busy-waiting threads: lower latency on an idle machine, wasted CPU on a shared one.
    ort_spin: bool = Field(False, description="let idle onnxruntime threads busy-wait (a little lower latency when the "
                                              "machine is otherwise idle)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    # who may call it
    token: SecretStr | None = Field(None, description="a token every call but the probes (/health, /ready, /metrics) "
                                                      "must send as 'Authorization: Bearer TOKEN'; a missing or wrong one "
                                                      "gets 401. Prefer --token-file or LENGTHWISE_SIDECAR_TOKEN: a flag "
                                                      "shows in ps. With a token, feedback may carry its prediction inline "
                                                      "(another replica's). Default: none, the sidecar is open")
    token_file: str | None = Field(None, description="read the token from this file (surrounding whitespace stripped), "
                                                     "at start")
    protect_health: bool = Field(False, description="/health, /ready and /metrics need the token too (default: open, for "
                                                    "load balancers and Prometheus)")
    lru_size: int = Field(100_000, ge=1, description="served predictions remembered for feedback")
    # registry and online monitoring
    reload_interval: float = Field(30.0, ge=0, description="seconds between polls of the alias; 0 disables hot reload")
    cache_versions: int = Field(3, ge=1, description="model versions kept in the local cache "
                                                     "($LENGTHWISE_HOME/cache/models): the newest this many and every "
                                                     "version an alias last pointed at; older ones are deleted once a "
                                                     "version has loaded")
    window_size: int = Field(100, ge=1, description="feedbacks per online-error window")
    window_seconds: float = Field(60.0, gt=0, description="or this age, whichever first")
    alarm_margin: float = Field(0.10, description="alarm when window accuracy < offline accuracy - margin")
    padding: float = Field(0.15, ge=0, description="under-prediction means actual > expected x (1 + padding)")
    window_key_share: float = Field(0.1, gt=0, le=1, description="the most of one online-error window that one client "
                                    "key's feedback may fill (the gateway names the key when it has several): at or "
                                    "below --alarm-margin, no single key can raise the drift alarm by itself. With fewer "
                                    "than 1/share keys sending traffic, windows fill by --window-seconds instead; 1 turns "
                                    "the cap off")
    max_actual_tokens: int = Field(32_768, ge=1, description="feedback whose actual_tokens exceed this gets 422 and is "
                                                             "not counted: set it to the served model's context "
                                                             "(max_model_len; lengthwise demo and the Ray backend do)")
    # the feedback store: served predictions and their actual lengths, kept as training data
    feedback_store: bool = Field(True, description="keep each served prediction's feedback (prompt, predicted distribution, "
                                                   "actual length, finish reason) in a local SQLite store for retraining; "
                                                   "--no-feedback-store turns it off")
    feedback_db: str | None = Field(None, description="the store's SQLite file (default: $LENGTHWISE_HOME/feedback.db)")
    store_prompts: bool = Field(True, description="keep the prompt turns in the store; --no-store-prompts keeps only "
                                                  "their sha256 (no prompt text on disk, but nothing to retrain on)")
    feedback_max_rows: int = Field(200_000, ge=1, description="rows the store keeps; the oldest go first")
    feedback_max_age_days: float = Field(30.0, gt=0, description="rows older than this are deleted")
    feedback_queue: int = Field(10_000, ge=1, description="rows waiting for the store's writer thread; more are dropped "
                                                          "(and counted), never waited for")
    lru_mb: float = Field(256.0, gt=0, description="memory for the prompts of served predictions awaiting feedback; "
                                                   "the oldest are forgotten first, like --lru-size")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of the sidecar and uvicorn")

    @model_validator(mode="before")
    @classmethod
    def _read_token_file(cls, data):
        """A token file given in code is read here, so an embedder never gets an open sidecar by mistake (the command
        line reads it first, to say what is wrong in one line)."""
        if isinstance(data, dict) and data.get("token_file") and data.get("token") is None:
            from predictor.sidecar.auth import read_token_file

            data = {**data, "token": read_token_file(data["token_file"])}
        return data
