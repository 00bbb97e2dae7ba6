"""The HTTP edge of llmfleet: validates requests, queues them on Redis, relays the workers' replies as SSE or JSON.

Layers, each importing only those below it (checked by import-linter, tests/test_architecture.py):
`api` (one module per API family: parse, call the service, choose the response) → `serve` (a
run's answer: the formatter contract, SSE or JSON, resumable replay, the request's end) → `http`
(the edge around every route: keys, body limits, error rendering, accounting) → `fleet` (the Redis
side: submit, relay, registry, cancels, keys, limits, stored state) → `settings`, `tenancy`,
`metrics` → `shared` (the wire contract).
"""
