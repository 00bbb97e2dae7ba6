"""The HTTP edge of llmfleet: OpenAI-compatible routes that queue work on Redis and relay replies."""
