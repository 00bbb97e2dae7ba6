"""Greedy streams while workers die: what the clients see when a worker is SIGKILLed every few seconds.

Scripted workers (`--workers`, each at `--tokens-per-second`), one gateway and Redis, as real
processes with the product's defaults (`--claim-idle` 3 s, heartbeat and lease TTL 3 s).
`--clients` clients send greedy streams (`temperature: 0`, `--max-tokens` each) back to back for
`--seconds`. Every `--kill-every` seconds one worker, chosen at random, is SIGKILLed and a new one
started in its place. A stream whose worker dies goes on on another worker, its replay joined
where it stood (gateway/fleet/replay.py).

Reported: streams, how many ended complete (the whole expected text, no error event), how many
with an error; how many were joined to a replay (the gateway's migrations counter); and for
those, the pause the client saw (the longest gap between two of its chunks; a stream that did not
move has gaps of one token), p50, p99 and max.

    python -m bench.migration [--seconds 60] [--clients 16] [--workers 3] [--kill-every 10]

Writes bench/results/migration.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import httpx

from bench.common import RESULTS, Stack, percentile, progress, save
from tests.procs import metric_value, start_gateway, start_worker, wait_until_served

MODEL = "migrating"
WORDS = ["tick", "tock"]


def _stream(url: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(WORDS)}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    text, error, stamps = "", None, []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                stamps.append(time.monotonic())
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                for choice in event.get("choices", ()):
                    text += choice["delta"].get("content") or ""
    except httpx.HTTPError as exc:
        error = repr(exc)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    expected = " ".join((WORDS * max_tokens)[:max_tokens])
    return {"complete": error is None and text == expected, "error": error, "pause_s": max(gaps, default=0.0)}


def run(seconds: float, clients: int, workers: int, kill_every: float, tokens_per_second: int,
        max_tokens: int) -> dict:
    rng = random.Random(7)
    results: list[dict] = []
    lock = threading.Lock()
    with Stack() as stack:
        pace = ("--scripted-tokens-per-second", str(tokens_per_second))
        fleet = [start_worker(stack.redis.url, MODEL, *pace) for _ in range(workers)]
        stack.procs += fleet
        gateway = start_gateway(stack.redis.url)
        stack.procs.append(gateway)
        wait_until_served(gateway, MODEL)
        end = time.monotonic() + seconds

        def client() -> None:
            while time.monotonic() < end:
                result = _stream(gateway.url, max_tokens)
                with lock:
                    results.append(result)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        kills = 0
        total_kills = int(seconds // kill_every)
        while kills < total_kills:
            time.sleep(kill_every)
            victim = fleet.pop(rng.randrange(len(fleet)))
            victim.kill()
            kills += 1
            fresh = start_worker(stack.redis.url, MODEL, *pace)
            fleet.append(fresh)
            stack.procs.append(fresh)
            progress("workers killed", kills, total_kills)
        for thread in threads:
            thread.join(180)
        migrations = metric_value(gateway.url, "llmfleet_gateway_migrations_total", model=MODEL)
    pauses = sorted(r["pause_s"] for r in results)
    moved = pauses[len(pauses) - int(migrations):] if migrations else []  # the longest pauses: the moved streams
    return {
        "config": {"seconds": seconds, "clients": clients, "workers": workers, "kill_every_s": kill_every,
                   "tokens_per_second": tokens_per_second, "max_tokens": max_tokens},
        "kills": kills, "streams": len(results), "complete": sum(r["complete"] for r in results),
        "errors": sum(r["error"] is not None for r in results), "joined": int(migrations),
        "pause_p50_s": percentile(moved, 50), "pause_p99_s": percentile(moved, 99),
        "pause_max_s": max(moved, default=None),
        "unmoved_pause_p99_s": percentile(pauses[: len(pauses) - len(moved)], 99),
        "error_samples": [r["error"] for r in results if r["error"]][:5], "moved_pauses_s": moved,
    }


def table(result: dict) -> str:
    def s(value):
        return "-" if value is None else f"{value:.2f}"
    return "\n".join([
        "| kills | streams | complete | errors | joined to a replay | pause p50 (s) | pause p99 (s) | pause max (s) "
        "| others' longest gap p99 (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {result['kills']} | {result['streams']} | {result['complete']} | {result['errors']} | {result['joined']} "
        f"| {s(result['pause_p50_s'])} | {s(result['pause_p99_s'])} | {s(result['pause_max_s'])} "
        f"| {s(result['unmoved_pause_p99_s'])} |",
    ])


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.hist(result["moved_pauses_s"] or [0], bins=20, color="#3b7dd8")
    ax.set_xlabel("pause a moved stream's client saw (s)")
    ax.set_ylabel("streams")
    ax.set_title(f"{result['joined']} streams joined to a replay, {result['kills']} workers killed")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "migration.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=10)
    parser.add_argument("--tokens-per-second", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=100)
    args = parser.parse_args(argv)
    return save("migration", run(args.seconds, args.clients, args.workers, args.kill_every, args.tokens_per_second,
                                 args.max_tokens), plot, table)


if __name__ == "__main__":
    main()
