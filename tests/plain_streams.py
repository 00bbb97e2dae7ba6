"""Plain streams both ways on one engine, for tests/test_vllm_plain_streams.py (run as a process of
its own, so that its engine goes with it): each request through the worker's plain path (`_Plain`,
worker/adapters/vllm.py), then through vLLM's own stream handler read back by `_StreamDecoder`.

    python -m tests.plain_streams MODEL_DIR   # prints {"plain": [...], "handled": [...], "plain_used": N}
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

CASES = [
    ("chat", {"messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 12, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 12, "n": 2, "seed": 3,
              "temperature": 1}),
    ("chat", {"messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 30, "temperature": 0,
              "stop": ["e"]}),
    ("chat", {"messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 30, "temperature": 0,
              "stop": ["e"], "include_stop_str_in_output": True}),
    ("chat", {"messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 8, "temperature": 0,
              "stream_options": {"include_usage": False}}),
    ("completion", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0}),
    ("completion", {"prompt": "Once upon", "max_tokens": 12, "n": 3, "seed": 5, "temperature": 1}),
    ("completion", {"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0, "stop_token_ids": [5]}),
    ("completion", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "min_tokens": 3}),
]


async def _stream(adapter, kind: str, body: dict) -> list:
    from shared.envelopes import RequestEnvelope, SamplingOptions

    params = SamplingOptions(temperature=body.get("temperature"), seed=body.get("seed"), n=body.get("n", 1))
    request = RequestEnvelope(request_id=uuid.uuid4().hex, model="tiny", kind=kind, reply_to="-", arrival=0.0,
                              stream=True, body={**body, "model": "tiny", "stream": True}, params=params)
    chunks = []
    async for c in adapter.generate(request):
        usage = c.usage and [c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens,
                             c.usage.created_cache_tokens, c.usage.reasoning_tokens]
        chunks.append([c.choice_index, c.text, c.reasoning, c.finish_reason, c.stop_reason, c.token_count,
                       c.first_token, usage, c.system_fingerprint, c.done, c.error and c.error.message,
                       c.output_ids])
    # Several choices' deltas interleave as the engine's outputs come: compare each choice in order.
    return sorted(chunks, key=lambda c: (c[9], c[0]))


async def main(model_dir: str) -> dict:
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from worker.adapters import vllm

    adapter = vllm.VLLMAdapter(AsyncEngineArgs(model=model_dir, served_model_name="tiny", dtype="float32",
                                               enforce_eager=True, max_model_len=512), "tiny",
                               enable_prompt_tokens_details=True)
    await adapter.start()
    plain_chunks, used = vllm._Plain.chunks, []

    def counted(self, system_fingerprint, engine_tokens=None):
        used.append(1)
        return plain_chunks(self, system_fingerprint, engine_tokens)

    try:
        vllm._Plain.chunks = counted
        plain = [await _stream(adapter, kind, body) for kind, body in CASES]
        vllm._Chat.chat_completion_stream_generator = OpenAIServingChat.chat_completion_stream_generator
        vllm._Completion.completion_stream_generator = OpenAIServingCompletion.completion_stream_generator
        handled = [await _stream(adapter, kind, body) for kind, body in CASES]
    finally:
        await adapter.shutdown()
    return {"plain": plain, "handled": handled, "plain_used": len(used)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
