"""A stand-in for another OpenAI-compatible server, in the dialect that once crashed the bench.

`python tests/standin_server.py PORT`: serves one model, `standin`, that answers every request with at most
STOP_AFTER tokens whatever max_tokens asked, streams its text only as `delta.reasoning_content` (never
`content`), sends no usage chunk, and slips one chunk no OpenAI client expects into every stream. Non-streaming
replies carry `usage`. The bench must count all of this right, and survive it.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

MODEL = "standin"
STOP_AFTER = 7               # tokens per reply, at most
TOKEN_INTERVAL_S = 0.005
# The bench's SIGABRT trial signals after the 5th text chunk; the words after it come this much later, so that the
# signal lands mid-stream even when a busy machine delays the client (at 5 ms the last two words left a 10 ms race,
# lost once in a full test run beside two busy loops). Only the bench's few streams pay it.
TAIL_INTERVAL_S = 0.25
TAIL_FROM_WORD = 5
ODD_CHUNK = {"object": "keepalive", "note": "not an OpenAI chunk"}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def words(body: dict) -> list[str]:
    return [f"w{i} " for i in range(min(int(body.get("max_tokens") or 16), STOP_AFTER))]


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    answer = words(body)
    if not body.get("stream"):
        return web.json_response({
            "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": None, "reasoning_content": "".join(answer)}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(answer), "total_tokens": 5 + len(answer)}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def send(payload: dict) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    await send({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    await response.write(b": a comment line, which SSE allows\n\n")
    for i, word in enumerate(answer):
        await send({"object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"reasoning_content": word}, "finish_reason": None}]})
        if i == 1:
            await send(ODD_CHUNK)
        await asyncio.sleep(TAIL_INTERVAL_S if i + 1 >= TAIL_FROM_WORD else TOKEN_INTERVAL_S)
    await send({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    await response.write(b"data: [DONE]\n\n")
    return response


def main() -> None:
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
