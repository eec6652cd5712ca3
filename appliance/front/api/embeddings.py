"""POST /v1/embeddings, as the OpenAI SDK sends it (`client.embeddings.create`, which asks for base64).

`input`: a string, a list of strings, a list of token ids, or a list of token-id lists; `encoding_format`:
float (default) or base64; `dimensions`: a Matryoshka size the model allows (else a 400 from its worker);
`truncate` (an openarc extension): cut inputs longer than the model's limit instead of refusing them.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import fields
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.results import ResultRequest, ResultRoute
from appliance.front.api.route import route
from appliance.front.request import Event

ENCODING_FORMATS = ("float", "base64")
MAX_TOKEN_ID = (1 << 31) - 1


def add_routes(app: web.Application, appliance: ServerView) -> None:
    results = ResultRoute(appliance, ("embedding",), parse, shape)
    app.router.add_post("/v1/embeddings", route(appliance, "embeddings", results.handler))


def parse(body: Any) -> ResultRequest:
    model = fields.model_name(body)
    inputs = _inputs(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}", "encoding_format")
    dimensions = fields.number(body, "dimensions", 1, 1 << 16, integer=True)
    return ResultRequest(model, len(inputs), {"input": inputs, "dimensions": dimensions, "encoding_format": encoding,
                                              "truncate": fields.flag(body, "truncate")})


def _inputs(value: Any) -> list:
    """A list of texts or a list of token-id lists; never empty, and no empty item."""
    if isinstance(value, str) or (isinstance(value, list) and value and _is_token(value[0])):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string, list of strings, or list of token-id lists", "input")
    texts = all(isinstance(item, str) for item in value)
    if not texts and not all(isinstance(item, list) and all(_is_token(t) for t in item) for item in value):
        raise InvalidRequest("'input' must be strings or token-id lists (integers 0..2^31-1), not a mix", "input")
    for i, item in enumerate(value):
        if not item:
            raise InvalidRequest(f"'input[{i}]' is empty", "input")
        if texts:
            fields.utf8(item, f"input[{i}]")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def shape(req: ResultRequest, event: Event) -> web.Response:
    """The response, assembled around the worker's vectors as they came: base64 strings, or JSON arrays as text
    (the worker prints the floats, on its own core, not on the front's event loop)."""
    as_base64 = req.body["encoding_format"] == "base64"
    data = ",".join(f'{{"object":"embedding","index":{i},"embedding":{json.dumps(vector) if as_base64 else vector}}}'
                    for i, vector in enumerate(event.result["embeddings"]))
    rest = json.dumps({"model": req.model, "usage": {"prompt_tokens": event.prompt_tokens,
                                                     "total_tokens": event.prompt_tokens}})
    return web.Response(text='{"object":"list","data":[' + data + "]," + rest[1:], content_type="application/json")
