"""A tool call half streamed, then continued from the engine's tokens, on real vLLM: for
tests/test_vllm_token_continuation.py (run as a process of its own, so that its engine goes with it).

The tiny random model cannot sample a well-formed call by itself: a structured output of one
choice (the call's exact text) makes it write one, greedily, through the hermes tool parser. The
stream runs whole; then it is cut after a delta in the middle of the call's arguments (not the last), and
continued from the engine's tokens sent up to there (`VLLMAdapter.generate(..., prefix_ids)`, as
a worker taking it over does), its structured output the rest of the same text: at each step the
same tokens are allowed as in the whole run, so greedy decoding picks the same ones, and what the
continuation's parser makes of them shows whether its state was rebuilt from the tokens.

    python -m tests.tool_call_continuation MODEL_DIR   # prints {"whole": [...], "sent": N, "continued": [...]}
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "note": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Saint-Malo", "note": "lighthouses"}}\n</tool_call>'
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Saint-Malo?"}], "tools": [TOOL],
        "tool_choice": "auto", "temperature": 0, "max_tokens": 80, "stream": True}


def _row(chunk) -> list:
    calls = [[call.index, call.id, call.name, call.arguments] for call in chunk.tool_calls or ()]
    usage = chunk.usage and [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
    return [chunk.text, chunk.reasoning, calls, chunk.finish_reason, chunk.token_count, chunk.output_ids,
            chunk.first_token, usage, chunk.done, chunk.error and chunk.error.message]


async def _stream(adapter, call_text: str, prefix: list[int]) -> list:
    from shared.envelopes import RequestEnvelope, SamplingOptions

    request = RequestEnvelope(request_id=uuid.uuid4().hex, model="tiny", kind="chat", reply_to="-", arrival=0.0,
                              stream=True, body={**BODY, "structured_outputs": {"choice": [call_text]}},
                              params=SamplingOptions(temperature=0))
    return [_row(chunk) async for chunk in adapter.generate(request, prefix)]


async def main(model_dir: str) -> dict:
    from vllm import AsyncEngineArgs

    from worker.adapters.vllm import VLLMAdapter

    adapter = VLLMAdapter(AsyncEngineArgs(model=model_dir, served_model_name="tiny", dtype="float32",
                                          enforce_eager=True, max_model_len=512), "tiny",
                          tool_call_parser="hermes", enable_auto_tool_choice=True)
    await adapter.start()
    try:
        # Under a structured output a stream is not one a takeover continues: an empty prefix asks
        # for its tokens all the same.
        # Cut after a delta in the middle of those that carry the call's arguments, never the last. A
        # busy machine can give the arguments in one delta (vLLM joins the outputs its consumer has
        # not taken yet): then there is no middle to cut at, and the run is made again.
        for _attempt in range(5):
            whole = await _stream(adapter, CALL, [])
            with_arguments = [at for at, row in enumerate(whole) if any(call[3] for call in row[2])]
            if len(with_arguments) >= 2:
                break
        cut = with_arguments[(len(with_arguments) - 1) // 2] + 1
        prefix = [token for row in whole[:cut] for token in row[5] or ()]
        so_far = adapter.engine.tokenizer.decode(prefix, skip_special_tokens=False)
        assert CALL.startswith(so_far), (so_far, CALL)
        continued = await _stream(adapter, CALL[len(so_far):], prefix)
    finally:
        await adapter.shutdown()
    return {"whole": whole, "sent": cut, "continued": continued}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
