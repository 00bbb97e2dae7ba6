"""Profile one gateway process under the relay load: where its CPU goes, per function.

Starts Redis, an unpaced scripted worker and a gateway (`bench.relay_throughput.Fleet`), puts
16-token streams (`--load stream`) or embeddings of one input, base64 (`--load embed`, an
unpaced scripted encoder) from closed-loop clients on it, and samples the gateway with py-spy
(`pip install py-spy`). Prints the functions with the most samples, by own time and
including callees, and keeps the raw stacks (flamegraph input) in bench/results/.

    python -m bench.profile_gateway [--load stream|embed] [--seconds 10] [--concurrency 32] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import uvloop

from bench.common import RESULTS
from bench.loadgen import Target, closed_loop, summarize
from bench.relay_throughput import BODY, MODEL, TOKENS, Fleet

EMBED_BODY = {"model": MODEL, "input": "the sea is calm tonight", "encoding_format": "base64"}


def record(seconds: float, concurrency: int, out: Path, load: str = "stream") -> dict:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    embed = load == "embed"
    with Fleet(worker_args=("--runner", "pooling") if embed else ()) as fleet:
        target = (Target(fleet.url, "/v1/embeddings", EMBED_BODY) if embed
                  else Target(fleet.url, "/v1/chat/completions", BODY))
        uvloop.run(closed_loop(target, concurrency, 1.0))  # warm-up
        spy = subprocess.Popen([py_spy, "record", "-p", str(fleet.pid), "-d", str(int(seconds)), "-r", "100",
                                "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
        results, elapsed = uvloop.run(closed_loop(target, concurrency, seconds))
        spy.wait()
    return summarize(results, elapsed, expected_tokens=None if embed else TOKENS)


def top_functions(raw: Path, count: int) -> str:
    """Own and inclusive sample shares of the busiest functions in py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = [re.sub(r" \(/.*?site-packages/", " (", frame) for frame in stack.split(";")]
        total += int(samples)
        own[frames[-1]] += int(samples)
        for frame in set(frames):
            inclusive[frame] += int(samples)
    lines = [f"{total} samples (100 per second of gateway CPU)", "", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(count)]
    lines += ["", "including callees:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(count * 2)
              if not frame.startswith(("_run_module_as_main", "_run_code", "<module>"))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", choices=("stream", "embed"), default="stream")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = RESULTS / "gateway_profile.txt"
    load = record(args.seconds, args.concurrency, raw, args.load)
    print(f"load: {load['requests_per_s']:.0f} req/s, {load['errors']} errors\n")
    print(top_functions(raw, args.top))


if __name__ == "__main__":
    main()
