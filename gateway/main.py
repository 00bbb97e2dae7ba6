"""The gateway process: uvicorn (uvloop, httptools) serving the FastAPI app."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.fleet import GatewaySettings


def serve(settings: GatewaySettings, host: str, port: int, log_level: str = "info") -> None:
    config = uvicorn.Config(create_app(settings), host=host, port=port, loop="uvloop", http="httptools",
                            log_level=log_level, access_log=False, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run()
