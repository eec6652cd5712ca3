"""The Open Responses specification's schemas (tests/fixtures/openresponses/schemas.json says its source and commit)
and the three ways a test reaches /v1/responses: a whole response, an SSE stream, a WebSocket.

Every response object, streamed event, compaction object and WebSocket error a helper here returns has been
validated against the spec's schema for it with the `jsonschema` library (the suite's own check is a Zod parse of
the same schemas). OpenAI's event names the spec does not list yet (EXTENSIONS) are let through by name only.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import jsonschema

from conftest import FIXTURES, http

SPEC = json.loads((FIXTURES / "openresponses" / "schemas.json").read_text())
SCHEMAS = SPEC["components"]["schemas"]
# the event type each streaming event schema names, from its `type` constant
EVENT_SCHEMAS = {SCHEMAS[name]["properties"]["type"]["enum"][0]: name for name in SPEC["streaming_events"]}
# OpenAI's events for items the spec has no event for (reasoning text as Codex reads it, custom tool input)
EXTENSIONS = ("response.reasoning_text.delta", "response.reasoning_text.done",
              "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done")
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def check(schema: str, instance: Any) -> Any:
    """`instance`, after every error the spec's `schema` finds in it failed the test."""
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{schema}", **SPEC})
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, f"{schema}: {errors[:5]}\n{json.dumps(instance)[:2000]}"
    return instance


def check_event(event: dict[str, Any]) -> dict[str, Any]:
    if event.get("type") in EXTENSIONS:
        return event
    assert event.get("type") in EVENT_SCHEMAS, f"an event the spec does not define: {event.get('type')}"
    return check(EVENT_SCHEMAS[event["type"]], event)


def whole(base: str, body: dict[str, Any], headers: dict | None = None) -> dict[str, Any]:
    status, _, response = http("POST", base + "/v1/responses", {**body, "stream": False}, headers)
    assert status == 200, response
    return check("ResponseResource", response)


def streamed(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the final response, every event) of an SSE stream."""
    status, headers, text = http("POST", base + "/v1/responses", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), text
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    return final(events), events


def final(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The checked events' final response (the last one carries it)."""
    for event in events:
        check_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in TERMINAL, events[-1]
    return events[-1]["response"]


def socket_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/responses"


async def socket_turns(base: str, *bodies: dict[str, Any], headers: dict | None = None) -> list[list[dict[str, Any]]]:
    """Each body sent as a response.create on one WebSocket, in turn: the messages each got back, up to its
    terminal event or its error message (checked: the spec's WebSocket error)."""
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(socket_url(base), headers=headers) as ws:
            return [await socket_turn(ws, body) for body in bodies]


async def socket_turn(ws, body: dict[str, Any]) -> list[dict[str, Any]]:
    await ws.send_json({"type": "response.create", **body})
    messages = []
    while True:
        message = await asyncio.wait_for(ws.receive_json(), 60)
        messages.append(message)
        if message["type"] in TERMINAL:
            return messages
        if message["type"] == "error" and "status" in message:
            check("WebSocketErrorEvent", message)
            return messages


def over_socket(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    [events] = asyncio.run(socket_turns(base, body))
    assert events[-1]["type"] != "error", events[-1]
    return final(events), events


TRANSPORTS = {"whole": lambda base, body: (whole(base, body), []), "sse": streamed, "websocket": over_socket}
