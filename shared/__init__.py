"""The wire contract between llmfleet gateways and workers: envelopes, codec, key names, errors,
and the batched Redis client both sides send their per-request commands with.

Imports neither FastAPI nor vLLM, so either side, or any other client, can depend on it.
"""
