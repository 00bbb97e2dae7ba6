"""The wire contract between llmfleet gateways and workers: envelopes, codec, key names, errors.

Imports neither FastAPI nor vLLM, so either side, or any other client, can depend on it.
"""
