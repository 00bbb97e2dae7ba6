"""The relay benchmark's baseline: uvicorn streaming the scripted engine's tokens itself.

Same HTTP stack and SSE shape as the gateway (uvloop, httptools, orjson), but no Redis and no
worker: the floor of what serving a stream costs on this machine.

    python -m bench.baseline_sse PORT
"""

from __future__ import annotations

import sys
import time

import orjson
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

app = FastAPI()


@app.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> StreamingResponse:
    body = await request.json()
    words = body["messages"][-1]["content"].split()
    created = int(time.time())

    async def events():
        for i in range(body["max_tokens"]):
            piece = words[i % len(words)] if i == 0 else " " + words[i % len(words)]
            chunk = {"id": "chatcmpl-baseline", "object": "chat.completion.chunk", "created": created,
                     "model": body["model"], "choices": [{"index": 0, "delta": {"content": piece},
                                                          "logprobs": None, "finish_reason": None}]}
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning")
