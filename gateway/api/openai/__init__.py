"""OpenAI's APIs: chat completions, completions, Responses, and vllm serve's /invocations."""
