"""POST /v1/rerank, /rerank and /v2/rerank, the shape Cohere, Jina and vLLM clients send.

`query`; `documents` as strings or {"text": ...} objects; `top_n` (default: all); `return_documents` (default
true, as Jina and vLLM answer); `truncate` true/false (or Cohere's "END"/"NONE"). Results come sorted by
`relevance_score`, each with the `index` of its document in the request.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import fields
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.results import ResultRequest, ResultRoute
from appliance.front.api.route import route
from appliance.front.request import Event

COHERE_TRUNCATE = {"END": True, "NONE": False}


def add_routes(app: web.Application, appliance: ServerView) -> None:
    handler = route(appliance, "rerank", ResultRoute(appliance, ("rerank",), parse, shape).handler)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Jina and vLLM; vLLM's bare path; Cohere's v2 client
        app.router.add_post(path, handler)


def parse(body: Any) -> ResultRequest:
    model = fields.model_name(body)
    query = fields.text(body.get("query"), "query")
    documents = _documents(body.get("documents"))
    top_n = fields.number(body, "top_n", 1, 1 << 31, integer=True)
    return_documents = body.get("return_documents") is None or fields.flag(body, "return_documents")
    return ResultRequest(model, len(documents), {"query": query, "documents": documents,
                                                 "truncate": _truncate(body), "top_n": top_n,
                                                 "return_documents": return_documents})


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'documents' must be a non-empty list of strings or {\"text\": ...} objects", "documents")
    texts = []
    for i, document in enumerate(value):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise InvalidRequest(f"'documents[{i}]' must be a string or an object with a string 'text'", "documents")
        texts.append(fields.utf8(text, f"documents[{i}]"))
    return texts


def _truncate(body: dict) -> bool:
    value = body.get("truncate", False)
    if isinstance(value, str) and value.upper() in COHERE_TRUNCATE:
        return COHERE_TRUNCATE[value.upper()]
    if not isinstance(value, bool):
        raise InvalidRequest("'truncate' must be true or false (or \"END\" / \"NONE\")", "truncate")
    return value


def shape(req: ResultRequest, event: Event) -> web.Response:
    documents = req.body["documents"]
    ranked = sorted(enumerate(event.result["scores"]), key=lambda item: (-item[1], item[0]))
    results = []
    for index, score in ranked[:req.body["top_n"] or len(ranked)]:
        result = {"index": index, "relevance_score": score}
        if req.body["return_documents"]:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex[:24]}", "model": req.model, "results": results,
                              "usage": {"prompt_tokens": event.prompt_tokens, "total_tokens": event.prompt_tokens}})
