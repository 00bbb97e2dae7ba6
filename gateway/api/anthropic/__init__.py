"""Anthropic's Messages API, as vllm serve converts it to chat."""
