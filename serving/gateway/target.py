"""Is the predictor made for the model the engines serve? The sidecar's target model against the gateway's ``--model``.

A predictor learns the lengths of whoever wrote its labels (:mod:`predictor.target`); scheduling one model's requests
by another model's lengths is a configuration mistake nothing else would notice: every request still gets a number.
So the gateway compares the two identities:

- its own: :func:`predictor.target.served_model_id` of ``--model`` (``name@hash`` of a local Hugging Face directory,
  with ``--load-format`` from ``--engine-arg``; only a name for a hub name or a GGUF file, and then names are compared);
- the predictor's: the ``target`` field of the sidecar's ``/health`` (what its loaded package records), with the
  serving version from ``/ready``.

The verdicts (:data:`STATES`), and what each does:

- ``match``: nothing to say.
- ``mismatch``: at start, ``lengthwise serve`` exits 2 with one line naming both models and the fix, unless
  ``--allow-predictor-for-other-model``; then it is logged, shown in ``/health``, the gauge
  ``lengthwise_gateway_predictor_target_mismatch`` is 1 and each request predicted by it is counted in
  ``lengthwise_gateway_predictions_for_other_model_total``. Found later (the sidecar was not up at start, or its
  alias moved to another version) without the flag, the gateway cannot refuse to start any more, so it stops asking
  that predictor: requests run on the fallback length (reason ``other_model``) until the sidecar serves a predictor
  for this model again.
- ``unknown``: the predictor records no target (a version registered before targets were recorded, or a sidecar too
  old to report it). A warning, not an error: there is nothing to compare, and refusing would stop every existing
  deployment at its next restart; register a version with a target to have it checked.
- ``loading`` / ``unreachable``: the sidecar has no model yet, or does not answer. As before this check existed, the
  gateway starts anyway (requests fall back until the sidecar answers) and re-checks every
  ``--predictor-check-interval`` seconds; the first answer is judged as above.
- ``unchecked``: no ``--predictor-url``, or no ``--model`` to compare with (attached engines without one).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from predictor.target import compare_models, describe, served_model_id
from serving.gateway.catalogue import ServedModel
from serving.gateway.settings import GatewaySettings

log = logging.getLogger("serving.gateway")
STATES = ("match", "mismatch", "unknown", "loading", "unreachable", "unchecked")
OVERRIDE_FLAG = "--allow-predictor-for-other-model"


@dataclass(frozen=True)
class TargetCheck:
    """One comparison of the predictor's target model with the served model."""

    state: str  # one of STATES
    served_model: str | None  # the gateway's identity of its model
    predictor_model: str | None = None  # the predictor's target model
    detail: str = ""  # one line: what was found
    target: dict[str, Any] | None = None  # the predictor's whole target description
    predictor_version: str | None = None  # "name version" of the sidecar's model, when it said
    by_name: bool = False  # only names could be compared (no hash on one side)
    conditioned: tuple[str, ...] | None = None  # the served models a conditioned predictor learnt, as its sidecar said
    uri: str | None = None  # what the sidecar serves (models:/NAME@ALIAS, models:/NAME/VERSION or a directory)

    @property
    def pending(self) -> bool:
        """The sidecar could not be asked yet: check again later."""
        return self.state in ("loading", "unreachable")

    def as_dict(self, override: bool) -> dict[str, Any]:
        """``/health``'s ``predictor_target``."""
        return {"state": self.state, "served_model": self.served_model, "predictor_model": self.predictor_model,
                "predictor_version": self.predictor_version, "compared_by_name_only": self.by_name,
                "override": override, "detail": self.detail, "target": self.target}


def served_model(settings: GatewaySettings) -> str | None:
    """The gateway's identity of the model it serves (None without ``--model``); dummy weights (``--load-format`` in an
    ``--engine-arg``) are another model, as ``lengthwise relabel`` counts them."""
    return served_model_id(settings.model, settings.engine_arg("--load-format") or "auto") if settings.model else None


def served_model_of_entry(entry: ServedModel, settings: GatewaySettings) -> str | None:
    """A catalogue base started here: its identity, :func:`served_model` of the settings its engines start with (its
    own ``engine_args`` after ``--engine-arg``'s); None for attached engines and adapters, which leave nothing local
    to compare with."""
    if entry.is_adapter or entry.model is None:
        return None
    return served_model(settings.model_copy(update={"model": entry.model,
                                                    "engine_args": [*settings.engine_args, *entry.engine_args]}))


def judge(served: str | None, health: dict[str, Any], version: str | None = None) -> TargetCheck:
    """The verdict from the sidecar's ``/health`` body (a sidecar that loaded its model)."""
    if "target" not in health:
        return TargetCheck("unknown", served, detail="the sidecar does not report its predictor's target model (an older "
                           "sidecar)", predictor_version=version)
    target = health["target"] if isinstance(health["target"], dict) else None
    predictor = target.get("model") if target else None
    if not isinstance(predictor, str) or not predictor:
        return TargetCheck("unknown", served, detail="the predictor records no target model (registered before targets "
                           "were recorded), so it cannot be checked against the served model; serve a version trained "
                           "and registered with one", target=target, predictor_version=version)
    if served is None:
        return TargetCheck("unchecked", None, predictor, f"the predictor predicts lengths of {describe(target)}; without "
                           "--model the gateway cannot compare it with what the engines serve", target, version)
    verdict = compare_models(served, predictor)
    by_name = verdict == "same_name"
    if verdict == "different":
        return TargetCheck("mismatch", served, predictor, f"the predictor{_of(version)} predicts lengths of "
                           f"{describe(target)}, but the engines serve {served}", target, version)
    return TargetCheck("match", served, predictor, f"the predictor{_of(version)} predicts lengths of {predictor}"
                       + (" (compared by name: --model is not a local model directory)" if by_name else ""),
                       target, version, by_name)


def _of(version: str | None) -> str:
    return f" ({version})" if version else ""


async def check(url: str | None, served: str | None, client: httpx.AsyncClient) -> TargetCheck:
    """Ask the sidecar at ``url`` which model its predictor is for and judge: ``/ready`` (503 while it loads; with the
    serving version, and the target where the sidecar puts it there), else ``/health``'s ``target``."""
    if url is None:
        return TargetCheck("unchecked", served, detail="no --predictor-url: every request runs on the fallback length")
    try:
        ready = await client.get(url + "/ready")
        if ready.status_code == 503:
            return TargetCheck("loading", served, detail=f"the sidecar at {url} has not loaded its model yet")
        info = ready.json() if ready.status_code == 200 else {}
        body = info if isinstance(info, dict) and "target" in info else None
        if body is None:
            health = await client.get(url + "/health")
            health.raise_for_status()
            body = health.json()
    except (httpx.HTTPError, ValueError) as exc:
        return TargetCheck("unreachable", served, detail=f"the sidecar at {url} did not answer ({type(exc).__name__})")
    if not isinstance(body, dict):
        return TargetCheck("unknown", served, detail=f"the sidecar at {url} answered /health with no object")
    info = info if isinstance(info, dict) else {}
    version = (f"{info['model_name']} version {info['model_version']}" if {"model_name", "model_version"} <= set(info)
               else None)
    models = info.get("conditioned_on_models")
    conditioned = tuple(models) if isinstance(models, list) and all(isinstance(m, str) for m in models) else None
    uri = info.get("model_uri") if isinstance(info.get("model_uri"), str) else None
    return dataclasses.replace(judge(served, body, version), conditioned=conditioned, uri=uri)


def refusal(found: TargetCheck, url: str | None) -> str:
    """The one line ``lengthwise serve`` exits with on a mismatch at start: both models and the two ways out."""
    return (f"the predictor at {url}{_of(found.predictor_version)} predicts response lengths of {found.predictor_model}, "
            f"but this gateway serves {found.served_model}; train one on the served model's own lengths "
            "('lengthwise relabel --model <served model>', then train-predictor on its output) and serve that, "
            f"or pass {OVERRIDE_FLAG} to schedule by this one anyway")


def announce(found: TargetCheck, override: bool) -> None:
    """Log a verdict: a warning for anything but a match (or nothing to check)."""
    if found.state == "mismatch":
        what = (f"{OVERRIDE_FLAG} given: scheduling by it anyway" if override
                else "its predictions are not used; requests run on the fallback length until the sidecar serves a "
                     f"predictor for {found.served_model} (or restart with {OVERRIDE_FLAG})")
        log.warning("predictor for another model: %s; %s", found.detail, what)
    elif found.state in ("unknown", "loading", "unreachable"):
        log.warning("predictor target %s: %s%s", found.state, found.detail, "; checked again later" if found.pending else "")
    elif found.state == "unchecked" and found.predictor_model:  # a check was possible with --model
        log.warning("predictor target unchecked: %s", found.detail)
    else:
        log.info("predictor target %s: %s", found.state, found.detail)


class TargetWatch:
    """The latest verdict and what hangs on it: the log (on a change), the mismatch gauge, whether predictions are used.

    ``initial`` is a verdict already announced (the command line checked before it started the gateway); without one
    the watch starts ``unchecked`` until its first :meth:`update`.
    """

    def __init__(self, served: str | None, override: bool, set_gauge: Callable[[float], None],
                 initial: TargetCheck | None = None) -> None:
        self.served, self.override, self.set_gauge = served, override, set_gauge
        self.current = initial or TargetCheck("unchecked", served, detail="not checked yet")
        set_gauge(1.0 if self.current.state == "mismatch" else 0.0)

    @property
    def refuses(self) -> bool:
        """Predictions of this predictor are not used: another model's, and no override."""
        return self.current.state == "mismatch" and not self.override

    @property
    def other_model(self) -> bool:
        """Predictions of this predictor are used although it is another model's (the override)."""
        return self.current.state == "mismatch" and self.override

    def update(self, found: TargetCheck) -> None:
        """Take a new verdict; announce it when it differs from the last one."""
        before, self.current = self.current, found
        self.set_gauge(1.0 if found.state == "mismatch" else 0.0)
        if (before.state, before.predictor_model, before.predictor_version) != (found.state, found.predictor_model,
                                                                                 found.predictor_version):
            announce(found, self.override)
