"""Relay throughput of one gateway process, against a bare SSE server measured in the same run.

Both serve the same 16-token chat streams to the same load (concurrent openai-style SSE
clients on loopback). The baseline is uvicorn streaming the tokens itself: no Redis, no worker,
so it is the floor of HTTP + SSE cost on this machine. llmfleet adds the queue: gateway →
Redis → scripted worker (no pacing) → Redis → gateway. The ratio is what the queue costs.

    python -m bench.relay_throughput [--seconds 15] [--concurrency 64]

Writes bench/results/relay_throughput.json and .png and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from bench.common import RESULTS, percentile
from tests.procs import free_port, spawn, start_gateway, start_redis, start_worker, wait_for, wait_until_served

TOKENS = 16
WORDS = "one two three four"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(url: str, model: str, seconds: float, concurrency: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": WORDS}], "max_tokens": TOKENS, "stream": True}
    ttfts: list[float] = []
    done = errors = tokens = 0
    until = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done, errors, tokens
        while time.monotonic() < until:
            started = time.monotonic()
            first = None
            text = ""
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            content = choice["delta"].get("content")
                            if content:
                                first = first or time.monotonic()
                                text += content
            if len(text.split()) == TOKENS:
                done += 1
                tokens += TOKENS
                ttfts.append((first - started) * 1000)
            else:
                errors += 1

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return {"requests": done, "errors": errors, "tokens": tokens, "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99)}


def _measure(name: str, url: str, model: str, pid: int, seconds: float, concurrency: int) -> dict:
    sys.stderr.write(f"{name}: {seconds:.0f}s at concurrency {concurrency}...\n")
    cpu_before, started = _cpu_seconds(pid), time.monotonic()
    result = asyncio.run(_load(url, model, seconds, concurrency))
    elapsed = time.monotonic() - started
    cpu = _cpu_seconds(pid) - cpu_before
    result.update(name=name, requests_per_s=result["requests"] / elapsed, tokens_per_s=result["tokens"] / elapsed,
                  server_cpu_ms_per_request=1000 * cpu / max(result["requests"], 1))
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    port = free_port()
    baseline = spawn("baseline-sse", [sys.executable, "-m", "bench.baseline_sse", str(port)])
    redis = start_redis()
    worker = start_worker(redis.url, "relay", "--max-concurrency", "256")
    gateway = start_gateway(redis.url)
    try:
        wait_until_served(gateway, "relay")
        base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base_url), 20, "the baseline server")
        results = [_measure("baseline: bare SSE server", base_url, "relay", baseline.pid, args.seconds,
                            args.concurrency),
                   _measure("llmfleet: gateway + Redis + worker", gateway.url, "relay", gateway.pid, args.seconds,
                            args.concurrency)]
    finally:
        for proc in (gateway, worker, redis, baseline):
            proc.stop()
    _report(results, args)
    return results


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _report(results: list[dict], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "relay_throughput.json").write_text(json.dumps(results, indent=2))
    base = results[0]
    print(f"\n{TOKENS}-token streams, {args.concurrency} concurrent clients, {args.seconds:.0f}s each, one server "
          "process, load generator on the same 2 cores\n")
    print("| server | req/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | server CPU ms/req | errors | req/s ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['requests_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['server_cpu_ms_per_request']:.2f} | {r['errors']} | "
              f"{r['requests_per_s'] / base['requests_per_s']:.2f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["baseline", "llmfleet"]
    axes[0].bar(names, [r["requests_per_s"] for r in results], color=["#999999", "#3b7dd8"])
    axes[0].set_title("requests/s")
    axes[1].bar(names, [r["ttft_p99_ms"] for r in results], color=["#999999", "#3b7dd8"])
    axes[1].set_title("TTFT p99 (ms)")
    fig.tight_layout()
    fig.savefig(RESULTS / "relay_throughput.png", dpi=110)


if __name__ == "__main__":
    main()
