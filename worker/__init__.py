"""The engine side of llmfleet: claims requests from Redis, runs them on an engine, publishes their chunks.

`main` (the process and the `Worker` that owns its parts) → `consumer` (reading and claiming),
`heartbeat` → `runner` (one request through the adapter of its kind), `cancels` → `adapters`
(the engines: vLLM, scripted), `publisher` (replies), `leases` → `metrics`, `settings`.
"""
