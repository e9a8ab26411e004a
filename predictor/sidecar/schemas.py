"""The sidecar's HTTP contract (pydantic models; FastAPI turns them into ``/openapi.json``).

Scripts outside the project rely on ``POST /v1/predict {"prompts": [...]}`` returning
``{"predictions": [{"bucket", "range", "probs", "expected_tokens", "quantile_tokens", "model_version", ...}]}``
(``edges``, the bucket boundaries ``probs`` refer to, is newer and optional: a client must not require it);
``{"prompt": ...}`` and ``{"messages": [...]}`` return the same list with one item. Constraints live in
the schema itself (non-blank text, list sizes, exactly one input field) so a client, the validator
and a schema-driven fuzzer all agree on what is valid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from monitoring.online import FINISH_REASONS

MAX_PROMPTS = 64  # prompts per request; the micro-batcher splits them across forward passes
MAX_MESSAGES = 256
_NON_BLANK = r"\S"  # JSON Schema patterns search, so this means "contains a non-whitespace character"

# No per-field length cap: the sidecar's body-size limit (413) bounds every text, and over-budget prompts are
# truncated like in training, so a cap here would only reject what the body limit already admits.
Text = Annotated[str, Field(min_length=1, pattern=_NON_BLANK)]


class ContentPart(BaseModel):
    """An OpenAI content part; only text parts count towards the prompt."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field("text", max_length=64)
    text: str | None = None


class Message(BaseModel):
    """An OpenAI-style chat message."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field("user", min_length=1, max_length=64, description="system, user, assistant, ...")
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of content parts")

    def text(self) -> str:
        if isinstance(self.content, list):
            return " ".join(p.text or "" for p in self.content)
        return self.content or ""


class AnswerSoFar(BaseModel):
    """The answer being written to the request, as far as it has come: a remaining-length predictor reads it."""

    model_config = ConfigDict(strict=True)
    text: str = Field(description="the answer's text so far")
    tokens: int = Field(ge=1, le=10_000_000, description="how many tokens the engine has written of it")


class PredictRequest(BaseModel):
    """Exactly one of ``prompt``, ``prompts`` or ``messages``."""

    # strict: "5" is not a number and 2.0 is not a count here, exactly as the schema says
    model_config = ConfigDict(strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["prompts"]}, {"required": ["messages"]}],
        "examples": [{"prompt": "Write a haiku about autumn."}, {"prompts": ["Hi!", "Explain TCP slow start in detail."]},
                     {"messages": [{"role": "user", "content": "Summarise the plot of Hamlet."}]}],
    })
    # optional keys, but never null: the schema says so (SkipJsonSchema drops "null") and _no_nulls enforces it
    prompt: Text | SkipJsonSchema[None] = Field(None, description="one prompt (a single user turn)")
    prompts: list[Text] | SkipJsonSchema[None] = Field(None, min_length=1, max_length=MAX_PROMPTS,
                                                       description="several independent prompts")
    messages: list[Message] | SkipJsonSchema[None] = Field(None, min_length=1, max_length=MAX_MESSAGES,
                                                           description="one OpenAI-style conversation; the last turn is "
                                                                       "the request")
    quantile: float = Field(0.9, gt=0.0, lt=1.0, description="CDF level of quantile_tokens (padded KV reservation)")
    request_id: str | None = Field(None, min_length=1, max_length=256,
                                   description="your id for this request; becomes the prediction_id (with /<i> per prompt "
                                               "when several)")
    model: str | SkipJsonSchema[None] = Field(None, min_length=1, max_length=256,
                                              description="the served model the request is for (the `model` of its "
                                                          "OpenAI request): needed by a predictor conditioned on the "
                                                          "model, which answers only for the models it was trained on")

    answer_so_far: AnswerSoFar | SkipJsonSchema[None] = Field(
        None, description="with prompt or messages: the answer written so far; the prediction is then of the tokens "
                          "still to come (a version trained on answers so far only: python -m serving.bench.predictor.remaining)")

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data):
        if isinstance(data, dict):
            for key in ("prompt", "prompts", "messages"):
                if key in data and data[key] is None:
                    raise ValueError(f"{key} must not be null: leave it out, or give text")
        return data

    @model_validator(mode="after")
    def _exactly_one_input(self) -> PredictRequest:
        given = [k for k in ("prompt", "prompts", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, prompts or messages (got {', '.join(given) or 'none'})")
        if self.messages is not None and not any(m.text().strip() for m in self.messages):
            raise ValueError("messages hold no text: at least one message needs non-empty content")
        if self.answer_so_far is not None and self.prompts is not None:
            raise ValueError("answer_so_far belongs to one request: give it with prompt or messages, not prompts")
        return self

    def conversations(self) -> list[list[tuple[str, str]]]:
        """Each prompt as ``[(role, text), ...]``, the form training encodes."""
        if self.prompt is not None:
            return [[("user", self.prompt)]]
        if self.prompts is not None:
            return [[("user", p)] for p in self.prompts]
        return [[(m.role, m.text()) for m in self.messages or []]]


MAX_REMAINING = 256  # items per remaining-length batch


class RemainingRequest(BaseModel):
    """Several running requests' answers so far at once (a gateway gathers its refinements for a few milliseconds):
    one HTTP call and one place in the sidecar's batches instead of one each."""

    model_config = ConfigDict(strict=True)
    items: list[PredictRequest] = Field(min_length=1, max_length=MAX_REMAINING,
                                        description="each with prompt or messages, and answer_so_far")

    @model_validator(mode="after")
    def _answers(self) -> RemainingRequest:
        for i, item in enumerate(self.items):
            if item.answer_so_far is None or item.prompts is not None:
                raise ValueError(f"items[{i}]: give prompt or messages with answer_so_far")
        return self


class Prediction(BaseModel):
    prediction_id: str = Field(description="send it back as request_id in /v1/feedback")
    bucket: int = Field(description="index of the most likely length bucket")
    range: tuple[int, int] = Field(description="[lo, hi) of that bucket in output tokens")
    probs: list[float] = Field(description="probability of each bucket")
    edges: list[int] | None = Field(None, description="the bucket boundaries in output tokens: the top of every bucket "
                                    "but the last, open one (the model's bucket edges without the leading 0): bucket 0 is "
                                    "[0, edges[0]), bucket i [edges[i-1], edges[i]), the last from edges[-1] up, so "
                                    "len(probs) == len(edges) + 1; absent from sidecars older than this field")
    expected_tokens: float = Field(description="expected output length under probs")
    quantile: float
    quantile_tokens: float = Field(description="output length at the requested CDF level")
    truncated: bool = Field(description="the prompt exceeded the model's input budget and was cut (latest turn kept)")
    prompt_tokens: int = Field(description="predictor input tokens after truncation")
    model_name: str
    model_version: str
    target: dict[str, Any] | str = Field(description="the model whose response lengths this version learned (model as "
                                         "name@hash, label_tokenizer, sampling, max_tokens), or a sentence saying the "
                                         "version records none")
    latency_ms: float = Field(description="server time for the whole request")
    predictor: str | None = Field(None, description="which predictor made this prediction: 'lengthwise' (the version's "
                                  "model) or the baseline its package routes this prompt's slice to (e.g. 'tfidf-logreg' "
                                  "for first turns; such a row reads the text directly: truncated false, prompt_tokens 0); "
                                  "absent from sidecars older than this field")
    generated_tokens: int | None = Field(None, description="with answer_so_far: the tokens written when this was "
                                                           "predicted; the distribution is of the tokens after them")
    overflow: bool = Field(False, description="true when the encoder could not reach this prompt before the caller's "
                           "x-lengthwise-timeout-ms and the package's fast tier answered it instead (predictor says which)")


class ItemRefused(BaseModel):
    error: str = Field(description="why this item got no prediction (the others did)")
    status: int = Field(description="the HTTP status a call of its own would have got")


class RemainingResponse(BaseModel):
    results: list[Prediction | ItemRefused] = Field(description="one per item, in order")
    latency_ms: float


class PredictResponse(BaseModel):
    predictions: list[Prediction]
    model_name: str
    model_version: str
    latency_ms: float


class InlinePrediction(BaseModel):
    """The prediction that was served, for feedback on ids the sidecar does not remember (another replica's, or from
    before a restart): taken only by a sidecar with a token, and only for a model version it serves or has served."""

    model_config = ConfigDict(strict=True)

    expected_tokens: float = Field(ge=0.0, le=1e9)
    bucket: int | None = Field(None, ge=0, le=100_000, description="defaults to the bucket of expected_tokens")
    quantile_tokens: float | None = Field(None, ge=0.0, le=1e9)
    model_name: str | None = Field(None, min_length=1, max_length=256)
    model_version: str | None = Field(None, min_length=1, max_length=64, description="defaults to the serving version")


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    request_id: str = Field(min_length=1, max_length=256, description="a prediction_id returned by /v1/predict")
    actual_tokens: int = Field(ge=0, le=10_000_000, description="output tokens the engine actually generated; more than "
                                                                "the sidecar's --max-actual-tokens gets 422")
    prediction: InlinePrediction | None = Field(None,
                                                description="needed only when the id is unknown (expired or another replica)")
    client: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[\w.:-]+$",
                               description="which client key the answer went to (the gateway says key-<i> when it has "
                                           "several keys): one key fills at most --window-key-share of an online window")
    finish_reason: Literal[FINISH_REASONS] | None = Field(  # type: ignore[valid-type]
        None, description="why the engine stopped: 'stop' (and 'tool_calls', 'function_call') means actual_tokens is the "
                          "answer's length; 'length' (capped at max_tokens), 'abort', 'content_filter' or 'error' mean "
                          "it was cut, so its true length is at least actual_tokens (a censored label); left out: "
                          "taken as finished")


class FeedbackResponse(BaseModel):
    accepted: bool = Field(description="counted in the online windows (false: a duplicate, which changes nothing)")
    duplicate: bool = Field(False, description="feedback on this prediction was already counted; this one changed nothing")
    request_id: str
    source: str = Field(description="'served' (remembered by this sidecar) or 'inline' (sent with the feedback: taken "
                                    "only by a sidecar with a token)")
    model_name: str
    model_version: str
    predicted_bucket: int
    actual_bucket: int
    error_tokens: float = Field(description="expected_tokens - actual_tokens (positive = over-prediction; for a censored "
                                            "answer an upper bound)")
    censored: bool = Field(False, description="the answer was cut: actual_tokens is a lower bound on its length")
    stored: bool = Field(False, description="queued for the local feedback store (training data)")


class ModelDrift(BaseModel):
    """One served model's part of a closed online-error window."""

    alarm: bool = Field(description="its part's top-1 accuracy fell below offline accuracy minus the margin (on at least "
                                    "the alarm's minimum of decided feedback)")
    window_accuracy: float | None = Field(description="its top-1 accuracy in that window (null: no decided feedback)")
    window_n: int = Field(description="its feedbacks in that window")


class Drift(BaseModel):
    """A version's drift alarm, from its last closed online-error window."""

    model_name: str
    model_version: str
    alarm: bool = Field(description="the window's top-1 accuracy fell below offline accuracy minus the margin")
    window_accuracy: float | None = Field(description="top-1 accuracy of the last closed window (null: no decided feedback)")
    window_n: int = Field(description="feedbacks in that window")
    window_censored: int = Field(description="of them, answers cut short")
    offline_accuracy: float | None = Field(description="the version's test-split accuracy (null: none recorded)")
    margin: float
    since: float | None = Field(description="unix time the current alarm began (null: no alarm)")
    closed_at: float = Field(description="unix time the window closed")
    models: dict[str, ModelDrift] = Field(default_factory=dict, description="each served model's part of that window "
                                          "(the requests named it): a predictor answering for several can drift on one")


class Health(BaseModel):
    status: str = Field(description="ok, or degraded: still serving, but see reasons")
    reasons: list[str] = Field(default_factory=list, description="why degraded: the alias cannot be resolved (registry "
                               "down, alias gone) or the last hot reload failed; the loaded version keeps serving")
    model_name: str | None = Field(None, description="the served model (null before the first load)")
    model_version: str | None = None
    target: dict[str, Any] | str = Field(description="the model the served version predicts lengths for, or why unknown")
    drift: dict[str, Drift] = Field(description="per model version that closed a window, by version: its drift alarm")


class Ready(BaseModel):
    status: str
    model_name: str
    model_version: str
    model_uri: str
    target: dict[str, Any] | str = Field(description="the model the served version predicts lengths for, or why unknown")
    from_cache_only: bool = Field(description="the registry was unreachable when this version was resolved")
    conditioned_on_models: list[str] | None = Field(None, description="the served models a predictor conditioned on "
                                                    "the model learnt (a request names one); null: a predictor for one "
                                                    "model")


class ErrorResponse(BaseModel):
    detail: str
