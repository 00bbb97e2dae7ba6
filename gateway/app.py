"""The gateway's FastAPI app: its services built once, its edge, and every API family's routes.

Any replica serves any request: requests go to Redis streams, replies come back on this
process's own reply stream, and the worker registry, keys, sessions and stored responses live in
Redis. The app holds no state of its own beyond open connections.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.api import fleet as fleet_routes
from gateway.api import invocations, sessions, streams, tokenizer
from gateway.api.anthropic import messages as anthropic_messages
from gateway.api.openai import chat as openai_chat
from gateway.api.openai import completions as openai_completions
from gateway.api.openai import responses as openai_responses
from gateway.api.pooling import routes as pooling_routes
from gateway.fleet.runs import Fleet
from gateway.http.accounting import CountResponses
from gateway.http.auth import FrontDoor
from gateway.http.body_limit import BodySizeLimit
from gateway.http.errors import install_error_handlers
from gateway.settings import GatewaySettings

# The busiest first: a request is matched against each route in turn until one takes it.
ROUTERS = (openai_chat.router, openai_completions.router, pooling_routes.router, anthropic_messages.router,
           invocations.router, openai_responses.router, streams.router, fleet_routes.router, tokenizer.router,
           sessions.router)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    fleet = Fleet(settings)  # the Redis side and its stores, built once; its loops run while the app does

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await fleet.start()
        try:
            yield
        finally:
            await fleet.stop()

    app = FastAPI(title="llmfleet gateway", lifespan=lifespan)
    app.state.fleet = fleet
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key or settings.require_keys:  # without keys, not a single check on any request
        # Before a body is read; its 401s are counted.
        app.add_middleware(FrontDoor, settings=settings, store=fleet.keys)
    # Outermost: it also counts the 413s of BodySizeLimit.
    app.add_middleware(CountResponses, log_requests=settings.enable_log_requests)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
