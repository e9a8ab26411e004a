"""How the scheduler plug-in is configured inside a vLLM engine.

vLLM loads the plug-in by class name (``--scheduler-cls serving.engine.scheduler.LengthwiseScheduler``)
and gives it nothing but its own config, so the plug-in's settings travel in vLLM's
``--additional-config '{"lengthwise": {...}}'`` (``VllmConfig.additional_config``), or, where an
engine is started by a script that cannot pass that, as JSON in ``$LENGTHWISE_SCHEDULER_CONFIG``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ENV = "LENGTHWISE_SCHEDULER_CONFIG"


class SchedulerSettings(BaseModel):
    """The policy and its knobs; engine limits (block size, max_num_seqs, budget, context) come from vLLM."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("lengthwise", description="policy name: vllm, sjf, ecoserve[-DSOP], lengthwise, ...")
    default_pred_len: float = Field(256.0, gt=0, description="tokens assumed for a request that carries no pred_len")
    tfs: int | None = Field(None, gt=0, description="target forward size; default: vLLM's max_num_batched_tokens")
    knobs: dict[str, Any] = Field(default_factory=dict, description="PolicyConfig fields: padding, reserve, buffer, aging_s, ...")
    log_every_s: float = Field(10.0, gt=0, description="interval of the plug-in's stats line in the engine log")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve the plug-in's counters as Prometheus "
                                                                          "metrics on this port (the gateway scrapes it)")
    metrics_host: str = Field("127.0.0.1", description="address of the metrics endpoint")

    @classmethod
    def from_vllm(cls, additional_config: Any) -> SchedulerSettings:
        raw: dict = {}
        if isinstance(additional_config, dict) and isinstance(additional_config.get("lengthwise"), dict):
            raw = additional_config["lengthwise"]
        elif os.environ.get(ENV):
            try:
                raw = json.loads(os.environ[ENV])
            except json.JSONDecodeError as exc:
                raise ValueError(f"${ENV} is not valid JSON ({exc.msg}); e.g. '{{\"policy\": \"ecoserve\"}}'") from None
        return cls.model_validate(raw)
