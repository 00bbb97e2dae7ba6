"""The gateway process: uvicorn (uvloop, httptools) serving the FastAPI app.

SIGTERM drains: /ready turns 503 and new requests are refused at once, open requests get up to
`drain_grace_s` to finish, then uvicorn shuts down. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.fleet import GatewaySettings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        fleet = getattr(self.app.state, "fleet", None)
        if self._drain is not None or fleet is None:
            super().handle_exit(sig, frame)
            return
        fleet.draining = True
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(fleet))

    async def _drain_then_exit(self, fleet) -> None:
        deadline = time.monotonic() + self.grace_s
        log.info("draining %d open requests (grace %.0fs)", fleet.router.open_requests, self.grace_s)
        while fleet.router.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def serve(settings: GatewaySettings, host: str, port: int, log_level: str = "info") -> None:
    app = create_app(settings)
    # No X-Forwarded-* rewriting: nothing here reads the client address, and the middleware
    # would wrap every request and every SSE write.
    # Idle keep-alive connections outlive those of the proxies and clients in front (nginx,
    # cloud load balancers: 60 s): a peer must never reuse a connection the gateway is closing,
    # which would surface as a reset on a request the gateway never saw.
    config = uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                            access_log=False, proxy_headers=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=75)
    # The modules loaded so far live as long as the process: keep them out of every collection,
    # so that a full collection with thousands of open streams scans only what those streams made.
    gc.collect()
    gc.freeze()
    DrainingServer(config, app, settings.drain_grace_s).run()
