"""Structured outputs: `response_format` (json_object, json_schema) and vLLM's `structured_outputs` extension
(json, regex, choice, grammar; the older top-level `guided_*` fields too), turned into one constraint for the
worker, which enforces it with openvino_genai.StructuredOutputConfig.

The front cannot compile a schema or grammar (it never imports OpenVINO): the worker checks each constraint with
genai itself before the request joins a batch, so an uncompilable one is a 400 for that request only.
"""

from __future__ import annotations

import json
from typing import Any

from appliance.front.api.bounds import bounded_grammar, bounded_regex, bounded_schema
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import json_object, text

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
REGEX_SPECIALS = set("\\.^$|?*+()[]{}")
ANY_JSON_OBJECT = '{"type": "object"}'


def constraint(body: dict) -> dict[str, Any] | None:
    """The request's output constraint, {"type": json_schema|regex|grammar, ..., "kind": metric label, "param":
    the request field it came from, "after_reasoning": true for response_format (on a reasoning model the answer
    after the think block is constrained; structured_outputs constrains the whole output as written)}, or None."""
    found = [c for c in (_response_format(body), _structured_outputs(body)) if c is not None]
    if len(found) > 1:
        raise InvalidRequest("use either 'response_format' or 'structured_outputs', not both", "structured_outputs")
    return found[0] if found else None


def _response_format(body: dict) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'response_format.type' must be one of text, json_object, json_schema", "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_schema", "schema": ANY_JSON_OBJECT, "kind": "json_object", "param": "response_format",
                "after_reasoning": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("'response_format.json_schema' must be an object with 'name' and 'schema'",
                             "response_format.json_schema")
    text(spec.get("name"), "response_format.json_schema.name")
    schema = spec.get("schema", {})
    return {"type": "json_schema", "schema": _schema_text(schema, "response_format.json_schema.schema"),
            "kind": "json_schema", "param": "response_format.json_schema.schema", "after_reasoning": True}


def _structured_outputs(body: dict) -> dict[str, Any] | None:
    spec = body.get("structured_outputs")
    guided = {kind: body[key] for key, kind in GUIDED_FIELDS.items() if body.get(key) is not None}
    if spec is None and not guided:
        return None
    if spec is not None and guided:
        raise InvalidRequest("use either 'structured_outputs' or the older 'guided_*' fields, not both",
                             "structured_outputs")
    if spec is None:
        spec = guided
    if not isinstance(spec, dict):
        raise InvalidRequest("'structured_outputs' must be an object", "structured_outputs")
    if spec.get("structural_tag") is not None:
        raise InvalidRequest("'structured_outputs.structural_tag' is not supported", "structured_outputs.structural_tag")
    kinds = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequest(f"'structured_outputs' takes exactly one of {', '.join(STRUCTURED_KINDS)}",
                             "structured_outputs")
    kind, value = kinds[0], spec[kinds[0]]
    where = f"structured_outputs.{kind}"
    if kind == "json_object":
        return {"type": "json_schema", "schema": ANY_JSON_OBJECT, "kind": "json_object", "param": where}
    if kind == "json":
        return {"type": "json_schema", "schema": _schema_text(value, where), "kind": "json_schema", "param": where}
    if kind == "choice":
        return {"type": "regex", "regex": choice_regex(value, where), "kind": "choice", "param": where}
    if kind in ("regex", "grammar"):
        bounded = (bounded_regex if kind == "regex" else bounded_grammar)(text(value, where), where)
        return {"type": kind, kind: bounded, "kind": kind, "param": where}
    return {"type": kind, kind: text(value, where), "kind": kind, "param": where}


def _schema_text(schema: Any, where: str) -> str:
    """A JSON Schema as the JSON text genai takes; a string is taken as already-serialised JSON."""
    if isinstance(schema, str):
        try:
            schema = json.loads(text(schema, where))
        except ValueError:
            raise InvalidRequest(f"'{where}' is not valid JSON", where) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    bounded_schema(json_object(schema, where), where)
    try:
        return json.dumps(schema, allow_nan=False)
    except ValueError:
        raise InvalidRequest(f"'{where}' holds a number JSON cannot carry (NaN or infinity)", where) from None


def choice_regex(choices: Any, where: str) -> str:
    """A regex matching exactly one of the strings (each escaped, so they are literal text)."""
    if not isinstance(choices, list) or not choices:
        raise InvalidRequest(f"'{where}' must be a non-empty list of strings", where)
    return "(" + "|".join(regex_literal(text(c, where)) for c in choices) + ")"


def regex_literal(value: str) -> str:
    return "".join("\\" + c if c in REGEX_SPECIALS else c for c in value)
