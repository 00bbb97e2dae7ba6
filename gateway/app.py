"""The gateway process: a FastAPI app with no state of its own beyond open connections.

Any replica serves any request: requests go to Redis streams, replies come back on this
process's own reply stream, and the worker registry lives in Redis.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import fleet_routes, sessions, streams, tokenizer_routes
from gateway.accounting import CountResponses
from gateway.anthropic import messages as anthropic_messages
from gateway.errors import install_error_handlers
from gateway.fleet import Fleet, GatewaySettings
from gateway.keys import FrontDoor
from gateway.limits import BodySizeLimit
from gateway.openai import chat as openai_chat
from gateway.openai import completions as openai_completions
from gateway.openai import invocations as openai_invocations
from gateway.openai import responses as openai_responses


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        fleet = Fleet(settings)
        app.state.fleet = fleet
        await fleet.start()
        try:
            yield
        finally:
            await fleet.stop()

    app = FastAPI(title="llmfleet gateway", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key or settings.require_keys:  # without keys, not a single check on any request
        app.add_middleware(FrontDoor, settings=settings)  # before a body is read; its 401s are counted
    # Outermost: it also counts the 413s of BodySizeLimit.
    app.add_middleware(CountResponses, log_requests=settings.enable_log_requests)
    install_error_handlers(app)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_invocations.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic_messages.router)
    app.include_router(streams.router)
    app.include_router(fleet_routes.router)
    app.include_router(tokenizer_routes.router)
    app.include_router(sessions.router)

    return app
