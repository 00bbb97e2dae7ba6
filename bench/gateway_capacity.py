"""What one gateway process can carry, with the scripted engine (engine cost ≈ 0).

Three measurements, each on fresh processes (Redis, one scripted worker, one gateway):

1. Relay throughput (`bench.relay_throughput`): 16-token streams from 64 closed-loop clients,
   against a bare SSE server in the same run; requests/s, relayed tokens/s, and the gateway's
   CPU per request and per token (from /proc/PID/stat).
2. Added time to first token: open-loop Poisson load at a few rates. The scripted engine
   answers with no first-token delay, so its own TTFT is zero and everything the client
   waits for is the path: HTTP in, Redis, worker claim, Redis, SSE out. The bare SSE server's
   TTFT at the same rate is the HTTP floor alone.
3. Open streams: streams paced at one token every 15 s (150 s each), all opened together
   (200 connecting at a time); the gateway's RSS is sampled as the number open at once passes
   each step (1k, 5k, 10k), and every stream must end with all its tokens and [DONE].

    python -m bench.gateway_capacity [--quick] [--before REF]

Writes bench/results/gateway_capacity.json and .png, prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time

import uvloop

from bench import relay_throughput
from bench.common import RESULTS, plot_bars, rss_bytes, save
from bench.loadgen import Target, hold_streams, open_loop, summarize
from bench.relay_throughput import BODY, MODEL, Fleet, baseline_server

HELD_TOKENS = 10  # × the token interval: long enough that the first streams outlive the ramp to the last


def added_ttft(rates: list[float], seconds: float) -> list[dict]:
    """Client-side TTFT at open-loop `rates`, llmfleet and the bare SSE server."""
    rows = []
    for name, server in (("baseline: bare SSE server", baseline_server), ("llmfleet", Fleet)):
        with server() as proc:
            target = Target(proc.url, "/v1/chat/completions", BODY)
            uvloop.run(open_loop(target, 50, 1.0))  # warm-up
            for rate in rates:
                sys.stderr.write(f"  TTFT {name}: {rate:.0f} req/s for {seconds:.0f}s...\n")
                results, elapsed = uvloop.run(open_loop(target, rate, seconds, seed=int(rate)))
                row = summarize(results, elapsed, expected_tokens=relay_throughput.TOKENS)
                rows.append({"name": name, "rate": rate, **row})
    return rows


def open_streams(steps: list[int], token_interval: float) -> dict:
    """Open max(steps) paced streams at once; gateway RSS as the open count passes each step."""
    total = max(steps)
    body = {**BODY, "max_tokens": HELD_TOKENS}
    worker_args = ("--scripted-tokens-per-second", str(1 / token_interval))
    with Fleet(worker_args=worker_args) as fleet:
        target = Target(fleet.url, "/v1/chat/completions", body, timeout=token_interval * HELD_TOKENS + 120)
        idle_rss = rss_bytes(fleet.pid)
        samples: dict[int, int] = {}
        peak = 0
        started = time.monotonic()

        def opened(count: int) -> None:
            nonlocal peak
            peak = max(peak, count)
            if count in steps and count not in samples:
                samples[count] = rss_bytes(fleet.pid)
                sys.stderr.write(f"  open streams: {count} after {time.monotonic() - started:.1f}s, gateway RSS "
                                 f"{samples[count] / 2**20:.0f} MiB\n")

        sys.stderr.write(f"  opening {total} streams (one token every {token_interval:.0f}s, "
                         f"{HELD_TOKENS} tokens each)...\n")
        results = uvloop.run(hold_streams(target, total, opened, connect_parallel=100))
        elapsed = time.monotonic() - started
    summary = summarize(results, elapsed, expected_tokens=HELD_TOKENS)
    return {
        "streams": total, "peak_open": peak, "completed": summary["requests"], "errors": summary["errors"],
        "first_errors": summary["first_errors"], "seconds": elapsed, "token_interval_s": token_interval,
        "idle_rss_mib": idle_rss / 2**20,
        "steps": [{"open": n, "rss_mib": samples[n] / 2**20, "kib_per_stream": (samples[n] - idle_rss) / 1024 / n}
                  for n in steps if n in samples],
    }


def run(quick: bool, before: str | None) -> dict:
    seconds = 5 if quick else 15
    sys.stderr.write("relay throughput (16-token streams, 64 clients)\n")
    throughput = relay_throughput.run(seconds, 64, before)
    sys.stderr.write("added time to first token (open loop)\n")
    ttft = added_ttft([50] if quick else [50, 200], 5 if quick else 10)
    sys.stderr.write("concurrent open streams\n")
    streams = open_streams([1000] if quick else [1000, 5000, 10000], 2.0 if quick else 15.0)
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "model": MODEL, "throughput": throughput,
            "ttft": ttft, "open_streams": streams}


def ttft_over_baseline(result: dict, row: dict) -> tuple[float, float] | None:
    """What llmfleet adds to the bare SSE server's TTFT at the same offered rate (p50, p99 differences)."""
    base = next((b for b in result["ttft"] if b["name"] != "llmfleet" and b["rate"] == row["rate"]), None)
    if base is None:
        return None
    return row["ttft_p50_ms"] - base["ttft_p50_ms"], row["ttft_p99_ms"] - base["ttft_p99_ms"]


def tables(result: dict) -> str:
    out = [relay_throughput.table(result["throughput"]), ""]
    out += ["| server | offered req/s | served req/s | TTFT p50 (ms) | TTFT p99 (ms) | added p50 / p99 (ms) | errors |",
            "|---|---|---|---|---|---|---|"]
    for r in result["ttft"]:
        added = ttft_over_baseline(result, r) if r["name"] == "llmfleet" else None
        out.append(f"| {r['name']} | {r['rate']:.0f} | {r['requests_per_s']:.0f} | {r['ttft_p50_ms']:.1f} | "
                   f"{r['ttft_p99_ms']:.1f} | {'' if added is None else f'{added[0]:+.1f} / {added[1]:+.1f}'} | "
                   f"{r['errors']} |")
    streams = result["open_streams"]
    out += ["", "| open streams | gateway RSS (MiB) | KiB per stream | completed | errors |", "|---|---|---|---|---|",
            f"| 0 | {streams['idle_rss_mib']:.0f} | | | |"]
    for step in streams["steps"]:
        out.append(f"| {step['open']} | {step['rss_mib']:.0f} | {step['kib_per_stream']:.1f} | | |")
    out.append(f"| all {streams['streams']} (at most {streams['peak_open']} open at once) | | | {streams['completed']} "
               f"| {streams['errors']} |")
    return "\n".join(out)


def plot(result: dict) -> None:
    relay_throughput.plot(result["throughput"])
    fleet_rows = [r for r in result["ttft"] if r["name"] == "llmfleet"]
    base_rows = [r for r in result["ttft"] if r["name"] != "llmfleet"]
    names = [f"{r['rate']:.0f}/s" for r in fleet_rows]
    plot_bars(RESULTS / "gateway_ttft.png", names, {
        "bare SSE TTFT p99 (ms)": [r["ttft_p99_ms"] for r in base_rows],
        "llmfleet TTFT p99 (ms)": [r["ttft_p99_ms"] for r in fleet_rows],
    })
    steps = result["open_streams"]["steps"]
    plot_bars(RESULTS / "gateway_streams.png", [str(s["open"]) for s in steps], {
        "gateway RSS (MiB) by open streams": [s["rss_mib"] for s in steps],
        "KiB per stream": [s["kib_per_stream"] for s in steps],
    })


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: shorter loads, 1k streams")
    parser.add_argument("--before", help="also measure relay throughput of llmfleet as of this git revision")
    args = parser.parse_args(argv)
    return save("gateway_capacity", run(args.quick, args.before), plot, tables)


if __name__ == "__main__":
    main()
