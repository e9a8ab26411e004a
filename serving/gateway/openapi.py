"""The gateway's OpenAPI contract: the request bodies it reads and the answers it gives, as pydantic models.

Why models that no route parses with: the routes read the raw body (:func:`serving.gateway.requests.parse_json`
refuses deep nesting and lone surrogates before any parser recurses, and the engine validates every field the
gateway does not read), so FastAPI would otherwise publish no request body at all. These models describe the same
contract for clients and for schema-driven fuzzing (schemathesis in ``tests/test_gateway_hostile.py``): the
fields :func:`~serving.gateway.requests.validate` checks, typed as it checks them, and every other OpenAI field
allowed through to the engine (``additionalProperties``). ``n`` carries the gateway's ``--max-n``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = Field(None, description="send a last chunk with the usage")


class _Common(BaseModel):
    """Fields both endpoints read; the rest (temperature, stop, logprobs, ...) goes to the engine as sent."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1, description="one of the names /v1/models lists")
    n: int | None = Field(None, ge=1, description="sequences per prompt, at most the gateway's --max-n")
    stream: bool | None = Field(None, description="answer as server-sent events")
    stream_options: StreamOptions | None = None
    vllm_xargs: dict[str, Any] | None = Field(
        None, description="vLLM's extra arguments; the scheduler's own keys are set by the gateway, a client's are dropped")


class CompletionRequest(_Common):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
             | Annotated[list[NonNegativeInt], Field(min_length=1)]
             | Annotated[list[Annotated[list[NonNegativeInt], Field(min_length=1)]], Field(min_length=1)]) = Field(
        ..., description="a string, strings, token ids or lists of token ids, none empty (only text is predicted from)")
    max_tokens: int | None = Field(None, ge=1, description="the answer's cap; predictions never exceed it")


class ContentPart(BaseModel):
    """A part the gateway reads, by its type's key (``text``, ``refusal``, ``thinking``, ``name``): media and other types
    are a 400 (:mod:`serving.gateway.chat_text`)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "input_text", "output_text", "refusal", "thinking", "tool_reference"]
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(..., min_length=1)
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the answer's cap (max_tokens is the legacy name)")
    max_tokens: int | None = Field(None, ge=1, description="legacy name of max_completion_tokens")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, the one the ``openai`` client parses (``serving.gateway.errors``)."""

    error: ErrorDetail


class Completion(BaseModel):
    """A non-streamed answer as the engine gives it (the gateway forwards it; only its envelope is fixed here)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


STATUS = {400: "the body is not a valid request (a message says what to fix)", 401: "missing or wrong API key",
          404: "no such model", 408: "the body did not arrive within --client-body-timeout (the connection is closed)",
          413: "the body is larger than --max-body-bytes", 429: "over the gateway's bound on sequences in flight, or "
          "over the API key's share of it; retry after Retry-After seconds", 499: "the client left before the answer",
          500: "an engine failed", 502: "the engines failed or are unreachable", 503: "no engine can serve now",
          504: "the engine did not answer in time"}


def request_body(model: type[BaseModel], max_n: int) -> dict[str, Any]:
    """``openapi_extra`` for a generation route: the JSON body (with ``n``'s upper bound) and no parameters."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    n = schema["properties"]["n"]
    for option in n.get("anyOf", [n]):
        if option.get("type") == "integer":
            option["maximum"] = max_n
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "x-components": defs}


def generation_responses() -> dict[int | str, dict[str, Any]]:
    """The answers of a generation route: the completion (JSON, or events when streamed) and the error shape."""
    # an event as a client reads it (and schemathesis checks each one): its data, a chunk's JSON or [DONE]
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    ok = {"description": "the answer; server-sent events when stream is true", "model": Completion,
          "content": {"text/event-stream": {"schema": event}}}
    return {200: ok, **{code: {"model": ErrorBody, "description": why} for code, why in STATUS.items()}}


def install(app, max_n: int) -> None:
    """Publish the request bodies' component schemas (their ``$defs``) beside FastAPI's own."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for item in schema.get("paths", {}).values():
            for op in item.values():
                components.update(op.pop("x-components", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
