"""Every field of a request checked against the type vLLM's own request models give it, before an engine sees it.

Why here and not only in the engine: vLLM validates its fields and answers a wrong one with a 400, but some of its
validators read a field before its type is checked (``"structured_outputs": 5`` made vLLM 0.32 answer 500, ``'int'
object has no attribute 'get'``), and an engine's 500 says the engine failed when the client did. The gateway holds
the JSON schemas of vLLM's ``ChatCompletionRequest`` and ``CompletionRequest`` (``vllm_requests.json`` beside this
module, written from the installed vLLM by ``make vllm-schema``; a test checks that it still matches), so it checks
types without importing vLLM. The check is strict where vLLM's pydantic is lax: ``"0.5"`` is not a number here, as
it is not in OpenAI's API. A field vLLM does not know passes (vLLM ignores it with a warning), and so do values the
schema cannot judge (``Any``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from serving.gateway.errors import ApiError
from serving.gateway.redact import quote

SCHEMA_FILE = Path(__file__).with_name("vllm_requests.json")
KINDS = {"chat": "ChatCompletionRequest", "completion": "CompletionRequest"}
_NOISE = ("title", "description", "examples", "default")  # what a type check does not need; dropped to keep the file small


@functools.cache
def _schemas() -> dict[str, Any]:
    schemas = json.loads(SCHEMA_FILE.read_text())
    return {kind: schemas[name] for kind, name in KINDS.items()}


@functools.cache
def _validator(kind: str) -> Any:
    import jsonschema_rs

    return jsonschema_rs.validator_for(_schemas()[kind])


def check(kind: str, body: dict[str, Any]) -> None:
    """A 400 naming the first field of ``body`` whose value vLLM's schema for ``kind`` refuses.

    jsonschema-rs checks a body of 2,000 messages in well under a millisecond (the pure-Python ``jsonschema`` took 200 ms,
    on the event loop); only a refused body pays for finding the deepest field to blame.
    """
    validator = _validator(kind)
    if validator.is_valid(body):
        return
    root = _schemas()[kind]
    err = next(iter(validator.iter_errors(body)))
    path, instance, schema = list(err.instance_path), err.instance, _at(root, list(err.schema_path)[:-1])
    wanted = None
    while (inner := _one_fitting(root, schema, instance)) is not None:  # a union where one option fits the JSON type
        import jsonschema_rs

        inner = {**inner, "$defs": root.get("$defs", {})}
        deeper = next(iter(jsonschema_rs.validator_for(inner).iter_errors(instance)), None)
        if deeper is None:
            break
        if not list(deeper.instance_path):  # the value itself: a bound, a pattern, a required key
            wanted = deeper.message[:200]
            break
        path += list(deeper.instance_path)
        instance, schema = deeper.instance, _at(inner, list(deeper.schema_path)[:-1])
    # a field's path names the client's keys (a logit_bias key may be 60,000 characters): cut, as every quote of input is
    name = quote("".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")) or None
    if wanted is not None:
        raise ApiError(400, f"'{name}': {wanted}" if name else wanted, param=name, code="invalid_value")
    wanted = "must be " + " or ".join(sorted({_name(o) for o in _options(root, schema)})) if schema else quote(err.message, 200)
    got = json.dumps(instance)[:60]
    raise ApiError(400, f"'{name}' {wanted}, got {got}" if name else f"the request {wanted}", param=name,
                   code="invalid_type")


def _resolve(root: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while isinstance(schema, dict) and "$ref" in schema and schema["$ref"].startswith("#/$defs/"):
        schema = root.get("$defs", {}).get(schema["$ref"].rsplit("/", 1)[-1], {})
    return schema


def _at(root: dict[str, Any], schema_path: list[Any]) -> dict[str, Any]:
    """The sub-schema at ``schema_path`` (keywords and indices from the root, ``$ref`` followed)."""
    node: Any = root
    for step in schema_path:
        node = _resolve(root, node) if step != "$ref" else node
        if step == "$ref":
            continue
        node = node[step] if isinstance(node, (dict, list)) and (isinstance(node, dict) and step in node or
                                                                  isinstance(node, list) and step < len(node)) else {}
    return _resolve(root, node) if isinstance(node, dict) else {}


def _options(root: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    return list(schema.get("anyOf") or schema.get("oneOf") or [schema])


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null"}


def _one_fitting(root: dict[str, Any], schema: dict[str, Any], instance: Any) -> dict[str, Any] | None:
    """The one option of a union whose JSON type the instance has (an object where one option is an object), resolved:
    the option the client meant, whose own error says more than "none of these"; None when no option or several fit."""
    if not schema or type(instance) not in _JSON_TYPES:
        return None
    kind = _JSON_TYPES[type(instance)]
    fits = [o for o in (_resolve(root, o) for o in _options(root, schema))
            if o.get("type") == kind or (kind == "integer" and o.get("type") == "number")
            or (kind == "object" and "properties" in o and "type" not in o)]
    return fits[0] if len(fits) == 1 and fits[0] is not schema else None


def _name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"a {schema['$ref'].rsplit('/', 1)[-1]} object"
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"][:8])
    t = schema.get("type")
    if isinstance(t, list):
        return " or ".join(map(str, t))
    if t == "array" and isinstance(schema.get("items"), dict):
        return f"an array of {_name(schema['items'])}"
    return {"object": "an object", "array": "an array", "null": "null", "string": "a string", "integer": "an integer",
            "number": "a number", "boolean": "true or false"}.get(t, "a value of another type") if t else "another value"


def _strip(node: Any, names: bool = False) -> Any:
    """``node`` without :data:`_NOISE`; ``names``: its keys are field names (a ``properties`` or ``$defs`` map), all kept."""
    if isinstance(node, dict):
        return {k: _strip(v, k in ("properties", "$defs") and not names) for k, v in node.items()
                if names or k not in _NOISE}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def vllm_schemas() -> dict[str, Any]:
    """The installed vLLM's request schemas, as :data:`SCHEMA_FILE` holds them (imports vLLM: seconds)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {name: _strip(model.model_json_schema()) for name, model in
            (("ChatCompletionRequest", ChatCompletionRequest), ("CompletionRequest", CompletionRequest))}


def write() -> Path:
    """Write :data:`SCHEMA_FILE` from the installed vLLM (``make vllm-schema``)."""
    SCHEMA_FILE.write_text(json.dumps(vllm_schemas(), indent=None, sort_keys=True, separators=(",", ":")) + "\n")
    return SCHEMA_FILE


if __name__ == "__main__":
    print(write())
