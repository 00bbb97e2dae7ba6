"""Parity with `vllm serve`: the same requests to both servers, compared field by field."""
