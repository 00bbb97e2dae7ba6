"""Where llmfleet's added time to first token goes: each request's stages, at an open-loop rate.

One gateway, Redis and an unpaced scripted worker (`bench.relay_throughput.Fleet`: the engine
adds nothing), chat streams of one token (`--tokens`) at Poisson arrivals, each asking for its
stage timings (`stream_options.include_timings`, the gateway's extension). Per request:

- `queue`: arrival at the gateway to the worker's claim (the enqueue, Redis, the worker's wake-up);
- `prefill`: the claim to the first token (the lease and the scripted engine's start);
- `relay`: the worker's end to the gateway reading it (the publish, Redis, the gateway's read).
  With one token the end comes with the first token, or in the publisher's next write, at most
  its coalescing period (2 ms) later, so this is the first token's relay or a little more;
- `rest`: the client's TTFT less those three: the request's way into the gateway before its
  arrival stamp, and the first event's way out to the client.

    python -m bench.ttft_stages [--rate 50] [--seconds 10] [--tokens 1]

Prints the percentiles of each stage (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import httpx
import orjson

from bench.common import percentile
from bench.relay_throughput import BODY, Fleet

STAGES = ("ttft", "queue", "prefill", "relay", "rest")


async def _one(client: httpx.AsyncClient, url: str, tokens: int) -> dict | None:
    body = {**BODY, "max_tokens": tokens, "stream_options": {"include_timings": True}}
    started = time.perf_counter()
    ttft, timings = None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices") or ()):
                ttft = time.perf_counter() - started
            timings = event.get("timings") or timings
    if ttft is None or timings is None:
        return None
    stages = {"ttft": ttft, "queue": timings["queue_s"], "prefill": timings["prefill_s"], "relay": timings["relay_s"]}
    stages["rest"] = ttft - stages["queue"] - stages["prefill"] - stages["relay"]
    return {name: 1000 * value for name, value in stages.items()}


async def measure(url: str, rate: float, seconds: float, tokens: int) -> list[dict | None]:
    arrivals = random.Random(0)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        started = time.monotonic()
        next_at = started
        while next_at < started + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, url, tokens)))
            next_at += arrivals.expovariate(rate)
        return await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args(argv)
    with Fleet() as fleet:
        asyncio.run(measure(fleet.url, args.rate, 1.0, args.tokens))  # warm-up
        sys.stderr.write(f"ttft stages: {args.rate:.0f} req/s for {args.seconds:.0f}s...\n")
        results = asyncio.run(measure(fleet.url, args.rate, args.seconds, args.tokens))
    done = [r for r in results if r is not None]
    rows = {stage: {q: percentile([r[stage] for r in done], q) for q in (50, 90, 99)} for stage in STAGES}
    print(f"{len(done)} of {len(results)} requests of {args.tokens} tokens at {args.rate:.0f} req/s; stage times "
          "in ms\n")
    print("| stage | p50 | p90 | p99 |\n|---|---|---|---|")
    for stage, row in rows.items():
        print(f"| {stage} | {row[50]:.2f} | {row[90]:.2f} | {row[99]:.2f} |")
    return {"rate": args.rate, "tokens": args.tokens, "requests": len(results), "completed": len(done), "stages": rows}


if __name__ == "__main__":
    main()
