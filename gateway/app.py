"""The gateway process: a FastAPI app with no state of its own beyond open connections.

Any replica serves any request: requests go to Redis streams, replies come back on this
process's own reply stream, and the worker registry lives in Redis.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from gateway import openai_chat, openai_completions
from gateway.errors import error_body, install_error_handlers, json_response
from gateway.fleet import Fleet, GatewaySettings
from gateway.limits import BodySizeLimit
from gateway.protocol import CancelRequest


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
    install_error_handlers(app)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)

    @app.post("/v1/cancel")
    async def cancel(body: CancelRequest, request: Request) -> Response:
        cancels = request.app.state.fleet.cancels
        if body.cancel_id is not None:
            count = await cancels.cancel(cancel_id=body.cancel_id)
        else:
            count = await cancels.cancel(request_id=body.request_id)
        return json_response({"cancelled": count})

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models = request.app.state.fleet.registry.models
        data = [
            {"id": view.name, "object": "model", "created": int(min(w.started for w in view.workers)),
             "owned_by": "llmfleet", "root": view.name, "parent": None, "max_model_len": view.max_model_len,
             "permission": []}
            for view in sorted(models.values(), key=lambda v: v.name)
        ]
        return json_response({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        if await request.app.state.fleet.ready():
            return json_response({"status": "ready"})
        return json_response(error_body("Redis is unreachable", 503), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version
        try:
            return json_response({"version": pkg_version("llmfleet")})
        except PackageNotFoundError:
            return json_response({"version": "0.0.0"})

    app.state.started = time.time()
    return app
