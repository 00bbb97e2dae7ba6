"""Serving a run's answer: the formatter contract, SSE or JSON, resumable replay, and the one owner of a request's end."""
