"""Which predictor answers each served name of a catalogue (``--models``): a sidecar, the name's own profile, or none.

Why per name: the names of one fleet are not equally known. A base may have a predictor trained on its own lengths,
a set of fine-tunes one predictor conditioned on their names, and a fine-tune added yesterday nothing yet. The
catalogue entry's ``predictor`` says which, and this module keeps, per name:

- ``sidecar``: a sidecar asked with the name (the entry's ``predictor_url``, else ``--predictor-url``), whose answers
  the name's feedback goes back to. Its verdict is checked per name (:func:`judge_entry`): a registry URI the entry
  names must be the one the sidecar serves, a predictor conditioned on several models must have learnt this name, and
  a predictor for one model must be for this entry's model where the gateway knows it (a base started here from a
  local directory). A mismatch stops ``serve`` at start, as for one model; found later, the name's requests run on the
  fallback length until it is mended (``--allow-predictor-for-other-model`` keeps them on it, counted).
- ``profile``: SeaLLM's service profile (SeaLLM §4.2): no prediction per request; the mean of the name's own recent
  finished answers, its spread as the bucket's top. Until the name has a learnt answer it runs on the fallback length
  (reason ``no_profile``). Only answers whose length is the model's own are learnt, by the rules every learner of
  lengths keeps (:mod:`serving.policy.learnable`: nothing the client set shaped it, one sequence, not cut at
  ``max_tokens`` or aborted), and the profile is a window of the latest 512 of them in which one client key holds at
  most a quarter: one key sending ``max_tokens: 1`` moved a Welford mean of every answer from 19.5 tokens to 1.5.
- ``none``: the fallback length (reason ``disabled``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from serving.gateway.catalogue import Catalogue, ServedModel
from serving.gateway.feedback import FeedbackPoster
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.prediction import LengthPrediction, Predictor, clamp
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.target import TargetCheck, TargetWatch, check, served_model_of_entry
from serving.policy.learnable import ClientWindow, refusal

log = logging.getLogger("serving.gateway")


def judge_entry(entry: ServedModel, found: TargetCheck) -> TargetCheck:
    """The verdict on ``found`` (the sidecar's, judged against the entry's model where the gateway knows it) for the
    entry: its registry URI, then a conditioned predictor's list of models, then ``found`` as it is."""
    if found.pending or (found.state == "unchecked" and found.predictor_model is None):
        return found
    uri = entry.predictor_uri
    if uri is not None and found.uri is not None and found.uri != uri:
        return TargetCheck("mismatch", found.served_model, found.uri, f"the sidecar serves {found.uri}, not the {uri} "
                           f"the catalogue names for {entry.name!r}", found.target, found.predictor_version)
    if found.conditioned is not None:
        if entry.name in found.conditioned:
            return TargetCheck("match", entry.name, entry.name, f"a predictor conditioned on {', '.join(found.conditioned)}"
                               f" answers for {entry.name!r}", found.target, found.predictor_version,
                               conditioned=found.conditioned, uri=found.uri)
        return TargetCheck("mismatch", entry.name, ", ".join(found.conditioned), "the sidecar's predictor is "
                           f"conditioned on {', '.join(found.conditioned)}, which does not include {entry.name!r} (it "
                           "would refuse its every request)", found.target, found.predictor_version,
                           conditioned=found.conditioned, uri=found.uri)
    return found


def entry_refusal(entry: ServedModel, found: TargetCheck, url: str | None) -> str:
    """The one line ``serve`` exits with when a catalogue entry's sidecar is not for it."""
    return (f"catalogue entry {entry.name!r}: the predictor at {url} is not for it: {found.detail}; point the entry's "
            "predictor_url at a sidecar that serves one for it, set its predictor to 'profile' or 'none', or pass "
            "--allow-predictor-for-other-model to schedule by it anyway")


def identities(catalogue: Catalogue, settings: GatewaySettings) -> dict[str, str | None]:
    """Each sidecar-predicted entry's model identity where the gateway knows it (:func:`served_model_of_entry`):
    computed once, it hashes the model's files."""
    return {e.name: served_model_of_entry(e, settings) for e in catalogue.models if e.predictor_kind == "sidecar"}


async def check_entries(catalogue: Catalogue, settings: GatewaySettings, served: dict[str, str | None],
                        client: httpx.AsyncClient) -> dict[str, TargetCheck]:
    """Each sidecar-predicted entry's verdict (``served``: :func:`identities`); each sidecar asked once per identity."""
    asked: dict[tuple[str | None, str | None], TargetCheck] = {}
    out = {}
    for name, identity in served.items():
        entry = catalogue.entry(name)
        assert entry is not None
        url = entry.predictor_url or settings.predictor_url
        if (url, identity) not in asked:
            asked[(url, identity)] = await check(url, identity, client)
        out[name] = judge_entry(entry, asked[(url, identity)])
    return out


class ProfilePredictor:
    """SeaLLM's service profile per name: the mean of its recent learnable answers' lengths, the spread above it the
    top; ``fallback`` (the gateway's, counted) until a name has one. Each name's profile is a :class:`ClientWindow`."""

    def __init__(self, fallback: Callable[[ClientRequest, str], LengthPrediction]) -> None:
        self.fallback = fallback
        self.profiles: dict[str, ClientWindow] = {}
        self.refused: dict[str, int] = {}  # per name: answers not learnt, their length not the model's own

    def predict(self, req: ClientRequest) -> LengthPrediction:
        p = self.profiles.get(req.model)
        if p is None or p.n == 0:
            return self.fallback(req, "no_profile")
        return LengthPrediction(clamp(p.mean, req.max_tokens), "profile", hi=max(1, round(p.mean + p.std)),
                                expected_tokens=p.mean)

    def learn(self, model: str, tokens: int, outputs: int = 1, finish_reason: str | None = None,
              shaped: str | None = None, client: str | None = None) -> str | None:
        """One finished answer of ``model``: ``tokens`` over its ``outputs`` sequences, which ended by ``finish_reason``;
        ``shaped`` is the field by which its request shaped its length (the gateway's judgement), ``client`` the key it
        went to (``key-<i>``). Returns why it was not learnt (:func:`~serving.policy.learnable.refusal`), or None."""
        why = refusal(shaped, finish_reason, outputs)
        if why is not None:
            self.refused[model] = self.refused.get(model, 0) + 1
            return why
        self.profiles.setdefault(model, ClientWindow()).add(tokens, client)
        return None

    def state(self, model: str) -> dict[str, Any]:
        """The profile as ``/health`` shows it: the answers it holds, their mean and spread, the answers refused as not
        the model's own, and the samples that pushed out their own key's oldest (one key holds at most its share)."""
        p = self.profiles.get(model) or ClientWindow()
        return {"answers": p.n, "mean_tokens": round(p.mean, 1), "std_tokens": round(p.std, 1),
                "refused": self.refused.get(model, 0), "over_share": p.over_share}


@dataclass
class Route:
    """How one served name is predicted: ``kind`` with its sidecar client, feedback poster and verdict (sidecar)."""

    kind: str
    url: str | None = None
    predictor: Predictor | None = None
    feedback: FeedbackPoster | None = None
    target: TargetWatch | None = None


class ModelPredictors:
    """The routes of a catalogue's names; ``default`` and ``default_feedback`` are ``--predictor-url``'s clients,
    shared by every entry without a sidecar of its own (one client per sidecar URL)."""

    def __init__(self, catalogue: Catalogue, settings: GatewaySettings, metrics: GatewayMetrics, default: Predictor,
                 default_feedback: FeedbackPoster, initial: dict[str, TargetCheck] | None = None,
                 auth: Callable[[httpx.AsyncClient], None] = lambda client: None) -> None:
        self.catalogue, self.settings = catalogue, settings
        self.served = identities(catalogue, settings)
        self.profile = ProfilePredictor(default.fallback)
        clients: dict[str | None, tuple[Predictor, FeedbackPoster]] = {settings.predictor_url: (default, default_feedback)}
        self.routes: dict[str, Route] = {}
        for entry in catalogue.models:
            if entry.predictor_kind != "sidecar":
                self.routes[entry.name] = Route(entry.predictor_kind)
                continue
            url = entry.predictor_url or settings.predictor_url
            if url not in clients:
                pair = (Predictor(url, settings.predictor_timeout_ms, settings.fallback_tokens, metrics, settings.keepalive_s),
                        FeedbackPoster(url if settings.feedback else None, metrics, keepalive_s=settings.keepalive_s))
                for client in (pair[0].client, pair[1].client):
                    if client is not None:
                        auth(client)
                clients[url] = pair
            gauge = metrics.model_predictor_target_mismatch.labels(entry.name).set
            start = (initial or {}).get(entry.name) or TargetCheck("unchecked", self.served[entry.name],
                                                                     detail="not checked yet")
            self.routes[entry.name] = Route("sidecar", url, *clients[url],
                                            TargetWatch(self.served[entry.name], settings.allow_predictor_for_other_model,
                                                        gauge, start))
        self._own = [pair for url, pair in clients.items() if url != settings.predictor_url]

    def route(self, model: str) -> Route | None:
        return self.routes.get(model)

    @property
    def checked(self) -> bool:
        """Some name is predicted by a sidecar: its verdicts are to be watched."""
        return any(r.kind == "sidecar" and r.url for r in self.routes.values())

    def refused(self) -> list[str]:
        """The names whose sidecar is not for them (and no override): their requests run on the fallback length."""
        return [name for name, r in self.routes.items() if r.target is not None and r.target.refuses]

    async def recheck(self, client: httpx.AsyncClient) -> None:
        """Judge every sidecar-predicted name again (a sidecar down at start, an alias moved)."""
        found = await check_entries(self.catalogue, self.settings, self.served, client)
        for name, verdict in found.items():
            target = self.routes[name].target
            if target is not None:
                target.update(verdict)

    def health(self) -> dict[str, dict[str, Any]]:
        """Per name: where its predictions come from, and the verdict or the profile."""
        out: dict[str, dict[str, Any]] = {}
        for name, r in self.routes.items():
            if r.kind == "sidecar":
                assert r.target is not None
                out[name] = {"predictor": "sidecar", "url": r.url, "uri": self.catalogue.entry(name).predictor_uri,
                             "target": r.target.current.as_dict(self.settings.allow_predictor_for_other_model)}
            elif r.kind == "profile":
                out[name] = {"predictor": "profile", **self.profile.state(name)}
            else:
                out[name] = {"predictor": "none"}
        return out

    async def aclose(self) -> None:
        for predictor, feedback in self._own:
            await feedback.aclose()
            await predictor.aclose()
