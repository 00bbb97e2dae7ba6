"""How long an idle worker stays idle while another has a backlog: affinity's stealing, measured.

Two scripted workers of one slot each, one Redis, two gateways: one with affinity (the
default), one with the plain shared queue (`--no-affinity`). A trial sends a long request and,
once a worker has claimed it, a short one of the same conversation:

- with affinity, the short request goes to the busy worker's own stream (its preferred worker,
  whose slot is taken), and the idle worker takes it after it has waited `--steal-after-ms`;
- with the shared queue, the idle worker's blocking read takes it at once: the floor.

The short request's queue wait (arrival at the gateway to a worker's claim, from the worker's
own timings, `include_timings`) is how long the idle worker stayed idle while that request
waited. Trials alternate between the two gateways, so drift hits both alike.

    python -m bench.steal_latency [--trials 40] [--steal-after-ms 10]

Writes bench/results/steal_latency.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import httpx

from bench.common import RESULTS, Stack, percentile, plot_bars, progress, save
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

MODEL = "steal-bench"
LONG_TOKENS = 40  # at 100 tokens/s: the busy worker's slot is taken for 0.4 s
ROUTINGS = ("shared queue", "affinity")


def _messages(trial: int) -> list[dict]:
    # Over shared.affinity.MIN_PROMPT_CHARS, so the request has an affinity key; one per trial.
    return [{"role": "system", "content": f"conversation {trial}: " + "a long shared system prompt " * 50},
            {"role": "user", "content": "hello"}]


def _claims(workers, source: str | None = None) -> float:
    labels = {"source": source} if source else {}
    return sum(metric_value(w.url, "llmfleet_worker_claims_total", model=MODEL, **labels) for w in workers)


def _trial(http: httpx.Client, gateway: str, workers, trial: int) -> dict:
    """One long request, then, while it runs, a short one of the same conversation: its queue wait."""
    claimed = _claims(workers)
    stolen = _claims(workers, "stolen")
    body = {"model": MODEL, "messages": _messages(trial)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_one = pool.submit(http.post, f"{gateway}/v1/chat/completions", json={**body, "max_tokens": LONG_TOKENS})
        wait_for(lambda: _claims(workers) > claimed, 10, "the long request to be claimed")
        short = http.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 1, "include_timings": True})
        short.raise_for_status()
        long_one.result().raise_for_status()
    return {"queue_ms": short.json()["timings"]["queue_s"] * 1000, "stolen": _claims(workers, "stolen") > stolen}


def run(trials: int, steal_after_ms: float) -> dict:
    with Stack() as stack:
        paced = ("--scripted-tokens-per-second", "100", "--max-concurrency", "1",
                 "--steal-after-ms", str(steal_after_ms))
        workers = [start_worker(stack.redis.url, MODEL, *paced) for _ in range(2)]
        stack.procs += workers
        gateways = {"shared queue": start_gateway(stack.redis.url, "--no-affinity"),
                    "affinity": start_gateway(stack.redis.url)}
        stack.procs += gateways.values()
        for gateway in gateways.values():
            wait_until_served(gateway, MODEL)
        samples: dict[str, list[dict]] = {routing: [] for routing in ROUTINGS}
        with httpx.Client(timeout=60) as http:
            for trial in range(trials):
                for routing in ROUTINGS if trial % 2 else reversed(ROUTINGS):
                    samples[routing].append(_trial(http, gateways[routing].url, workers, trial))
                progress("steal latency trials", trial + 1, trials)
    rows = []
    for routing in ROUTINGS:
        waits = [s["queue_ms"] for s in samples[routing]]
        rows.append({"routing": routing, "trials": len(waits), "stolen": sum(s["stolen"] for s in samples[routing]),
                     "queue_p50_ms": percentile(waits, 50), "queue_p99_ms": percentile(waits, 99),
                     "queue_max_ms": max(waits), "queue_mean_ms": statistics.fmean(waits), "waits_ms": waits})
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "steal_after_ms": steal_after_ms, "rows": rows}


def table(result: dict) -> str:
    lines = [(f"Steal period {result['steal_after_ms']:g} ms; the short request's queue wait (ms), while the "
              "other worker's only slot was busy:"), "",
             "| routing | trials | taken by stealing | p50 | p99 | max | mean |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['routing']} | {r['trials']} | {r['stolen']} | {r['queue_p50_ms']:.1f} | {r['queue_p99_ms']:.1f} | "
              f"{r['queue_max_ms']:.1f} | {r['queue_mean_ms']:.1f} |" for r in result["rows"]]
    return "\n".join(lines)


def plot(result: dict) -> None:
    rows = result["rows"]
    plot_bars(RESULTS / "steal_latency.png", [r["routing"] for r in rows],
              {"queue wait p50 (ms)": [r["queue_p50_ms"] for r in rows],
               "queue wait p99 (ms)": [r["queue_p99_ms"] for r in rows]})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--steal-after-ms", type=float, default=10)
    args = parser.parse_args(argv)
    sys.stderr.write(f"steal latency: {args.trials} trials per routing\n")
    return save("steal_latency", run(args.trials, args.steal_after_ms), plot, table)


if __name__ == "__main__":
    main()
