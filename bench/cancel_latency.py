"""Disconnect-to-abort latency on the vLLM worker under load.

A client opens a stream, reads a few tokens, and closes the connection at time t0. The worker
logs the wall-clock moment the engine yielded its last output for that request (t1, the engine
has stopped producing tokens). Latency = t1 - t0, across processes on one machine, so one clock.
Background streams keep the engine busy the whole time.

    python -m bench.cancel_latency [--trials 60] [--load 8]

Writes bench/results/cancel_latency.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time

import httpx

from bench.common import RESULTS, Stack, percentile, progress

ABORT_LINE = re.compile(r"aborted request (\w+): engine stopped at ([\d.]+)")


def _background_load(url: str, model: str, stop: threading.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "keep going"}], "max_tokens": 1500,
            "stream": True, "temperature": 1.0}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break


def _one_trial(url: str, model: str) -> tuple[str, float]:
    body = {"model": model, "messages": [{"role": "user", "content": "cancel me"}], "max_tokens": 1500,
            "stream": True, "temperature": 1.0}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions",
                                                             json=body) as response:
        request_id, contents, lines = None, 0, response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                request_id = event["id"].removeprefix("chatcmpl-")
                contents += 1
            if contents >= 5:
                break
        # Stamp before closing: dropping the line iterator is what closes the connection.
        closed_at = time.time()
        lines.close()
        response.close()
    return request_id, closed_at


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--load", type=int, default=8, help="background streams keeping the engine busy")
    args = parser.parse_args(argv)

    with Stack() as stack:
        model = stack.start_vllm()
        stop = threading.Event()
        loaders = [threading.Thread(target=_background_load, args=(stack.gateway_url, model, stop), daemon=True)
                   for _ in range(args.load)]
        for thread in loaders:
            thread.start()
        closes = {}
        for i in range(args.trials):
            request_id, closed_at = _one_trial(stack.gateway_url, model)
            closes[request_id] = closed_at
            progress("cancel trials", i + 1, args.trials)
        time.sleep(1.0)  # let the last aborts reach the worker log
        stop.set()
        stopped = {m.group(1): float(m.group(2)) for m in ABORT_LINE.finditer(stack.worker_log())}

    latencies = sorted((stopped[r] - t) * 1000 for r, t in closes.items() if r in stopped)
    result = {
        "trials": args.trials, "measured": len(latencies), "background_streams": args.load,
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "mean_ms": statistics.fmean(latencies) if latencies else None, "max_ms": max(latencies, default=None),
        "target_p99_ms": 50, "latencies_ms": latencies,
    }
    _report(result)
    return result


def _report(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cancel_latency.json").write_text(json.dumps(result, indent=2))
    print("\n| trials measured | background streams | p50 (ms) | p99 (ms) | max (ms) | target p99 |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['measured']}/{result['trials']} | {result['background_streams']} | {result['p50_ms']:.1f} | "
          f"{result['p99_ms']:.1f} | {result['max_ms']:.1f} | ≤ 50 ms |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(result["latencies_ms"], bins=30, color="#3b7dd8")
    ax.axvline(result["p99_ms"], color="red", linestyle="--", label=f"p99 {result['p99_ms']:.1f} ms")
    ax.axvline(50, color="gray", linestyle=":", label="target 50 ms")
    ax.set_xlabel("client disconnect → engine stopped (ms)")
    ax.set_ylabel("requests")
    ax.set_title(f"Cancel latency under load ({result['background_streams']} streams)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "cancel_latency.png", dpi=110)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
