"""The aiohttp application the front serves: the two middlewares (appliance.front.middleware) in front of every route
family of appliance.front.api, each mounted with `add_routes(app, appliance)`.

A module of its own so that what the front serves is listed in one place, apart from the Appliance, which only
runs it (setup, start, drain, cleanup). A new route family is one more line here.
"""

from __future__ import annotations

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import (adapters, audio, dialects, embeddings, generate, health, image_generation,
                                  models, rerank, speech, sse)
from appliance.front.middleware import Middlewares


def make_app(appliance: ServerView) -> web.Application:
    """The app of `appliance` (appliance.front.server.Appliance), which its routes and middlewares read."""
    middlewares = Middlewares(appliance)
    app = web.Application(client_max_size=appliance.config.server.max_body_bytes,
                          middlewares=[middlewares.errors, middlewares.auth])
    app.on_response_prepare.append(sse.record_prepared)  # a request whose answer began is never answered again
    app[sse.KEEPALIVE_INTERVAL] = lambda: appliance.config.server.stream_keepalive_s  # as a reload leaves it
    for family in (health, generate, dialects, embeddings, rerank, audio, speech, image_generation, models, adapters):
        family.add_routes(app, appliance)
    app.on_cleanup.append(lambda app: appliance.prompt_counter.close())
    return app
