"""Streams while workers die: what the clients see when a worker is SIGKILLed every few seconds.

Scripted workers (`--workers`, each at `--tokens-per-second`), one gateway and Redis, as real
processes with the product's defaults (`--claim-idle` 3 s, heartbeat and lease TTL 3 s).
`--clients` clients send streams (`--max-tokens` each) back to back for `--seconds`. Every
`--kill-every` seconds one worker, chosen at random, is SIGKILLed and a new one started in its
place. A stream whose worker dies goes on on another worker (gateway/fleet/replay.py), greedy
(`temperature: 0`) or sampled (`temperature: 0.8`): continued from the engine's tokens its client
was sent (the scripted engine sends a token per word, as vLLM's worker sends its tokens; before
2026-11-27, a greedy one was run again and joined where it stood, a sampled one continued from its
text). One run for each of `--temperatures` (default: both kinds), on fresh processes. With
`--before REF`, each run is made twice, llmfleet as of git revision REF first (its gateway and
workers from `git archive REF`), then this tree: the pause before and after a change, from one
run of the bench.

Reported, per run: streams, how many ended complete (the whole expected text, no error event), how
many with an error; how many moved (the gateway's migrations counter); and for those, the pause
the client saw (the longest gap between two of its chunks; a stream that did not move has gaps
of one token), p50, p99 and max.

    python -m bench.migration [--seconds 60] [--clients 16] [--workers 3] [--kill-every 10] [--temperatures 0,0.8]
                              [--before REF]

Writes bench/results/migration.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time

import httpx

from bench.common import RESULTS, Stack, percentile, progress, save, source_tree
from tests.procs import metric_value, start_gateway, start_worker, wait_until_served

MODEL = "migrating"
WORDS = ["tick", "tock"]


def _stream(url: str, max_tokens: int, temperature: float) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(WORDS)}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True}
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
        max_tokens: int, temperature: float, source: str | None = None, revision: str = "this tree") -> dict:
    rng = random.Random(7)
    results: list[dict] = []
    lock = threading.Lock()
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None
    with Stack() as stack:
        pace = ("--scripted-tokens-per-second", str(tokens_per_second))
        fleet = [start_worker(stack.redis.url, MODEL, *pace, env=env) for _ in range(workers)]
        stack.procs += fleet
        gateway = start_gateway(stack.redis.url, env=env)
        stack.procs.append(gateway)
        wait_until_served(gateway, MODEL)
        end = time.monotonic() + seconds

        def client() -> None:
            while time.monotonic() < end:
                result = _stream(gateway.url, max_tokens, temperature)
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
            fresh = start_worker(stack.redis.url, MODEL, *pace, env=env)
            fleet.append(fresh)
            stack.procs.append(fresh)
            progress(f"workers killed ({revision}, temperature {temperature})", kills, total_kills)
        for thread in threads:
            thread.join(180)
        migrations = metric_value(gateway.url, "llmfleet_gateway_migrations_total", model=MODEL)
    pauses = sorted(r["pause_s"] for r in results)
    moved = pauses[len(pauses) - int(migrations):] if migrations else []  # the longest pauses: the moved streams
    return {
        "config": {"seconds": seconds, "clients": clients, "workers": workers, "kill_every_s": kill_every,
                   "tokens_per_second": tokens_per_second, "max_tokens": max_tokens},
        "revision": revision, "temperature": temperature, "kills": kills, "streams": len(results),
        "complete": sum(r["complete"] for r in results),
        "errors": sum(r["error"] is not None for r in results), "moved": int(migrations),
        "pause_p50_s": percentile(moved, 50), "pause_p99_s": percentile(moved, 99),
        "pause_max_s": max(moved, default=None),
        "unmoved_pause_p99_s": percentile(pauses[: len(pauses) - len(moved)], 99),
        "error_samples": [r["error"] for r in results if r["error"]][:5], "moved_pauses_s": moved,
    }


def _kind(run_: dict) -> str:
    kind = "greedy" if run_["temperature"] == 0 else f"sampled, {run_['temperature']:g}"
    return kind if run_.get("revision", "this tree") == "this tree" else f"{kind}, {run_['revision']}"


def table(result: dict) -> str:
    def s(value):
        return "-" if value is None else f"{value:.2f}"
    lines = ["| streams | kills | streams run | complete | errors | moved | pause p50 (s) | pause p99 (s) "
             "| pause max (s) | others' longest gap p99 (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run_ in result["runs"]:
        lines.append(f"| {_kind(run_)} | {run_['kills']} | {run_['streams']} | {run_['complete']} | {run_['errors']} "
                     f"| {run_['moved']} | {s(run_['pause_p50_s'])} | {s(run_['pause_p99_s'])} "
                     f"| {s(run_['pause_max_s'])} | {s(run_['unmoved_pause_p99_s'])} |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    top = max((max(r["moved_pauses_s"], default=0) for r in result["runs"]), default=0) or 1
    for run_, color in zip(result["runs"], ("#3b7dd8", "#e07b39", "#5aa469", "#b05cc6"), strict=False):
        ax.hist(run_["moved_pauses_s"] or [0], bins=20, range=(0, top), alpha=0.7, color=color,
                label=f"{_kind(run_)}: {run_['moved']} moved")
    ax.set_xlabel("pause a moved stream's client saw (s)")
    ax.set_ylabel("streams")
    ax.set_title(f"streams moved while a worker was killed every {result['runs'][0]['config']['kill_every_s']:g} s")
    ax.legend(fontsize=8)
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
    parser.add_argument("--temperatures", default="0,0.8", help="one run for each, comma-separated")
    parser.add_argument("--before", help="also run llmfleet as of this git revision, before each run of this tree")
    args = parser.parse_args(argv)
    runs = []
    with contextlib.ExitStack() as stack:
        revisions = [(stack.enter_context(source_tree(args.before)), args.before)] if args.before else []
        for temperature in args.temperatures.split(","):
            for source, revision in [*revisions, (None, "this tree")]:
                runs.append(run(args.seconds, args.clients, args.workers, args.kill_every, args.tokens_per_second,
                                args.max_tokens, float(temperature), source, revision))
    return save("migration", {"runs": runs}, plot, table)


if __name__ == "__main__":
    main()
