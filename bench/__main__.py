"""The whole benchmark harness, one command: `python -m bench` (or `make bench`).

Runs, in order, each on fresh processes: gateway capacity (scripted engine), the engine path
(`vllm bench serve` against vllm serve, llmfleet and LiteLLM), cancel latency (vLLM worker),
fair share between tenants (scripted workers), cache affinity (scripted, scripted with a
bounded cache, then vLLM workers), embeddings (encoder workers against `vllm serve --runner pooling`)
and the Rust routers (vllm-router and sglang-router in front of `vllm serve`, against llmfleet).
Progress goes to stderr; each part writes bench/results/NAME.json and its PNG; then
docs/benchmarks.md is rebuilt from those results (`bench.report`).

    python -m bench [--quick] [--before REF] [--only gateway,engine,cancel,fairness,affinity,affinity-bounded,
                                                     affinity-vllm,embeddings,routers]

`--quick` is a smoke run of a few minutes; its report goes to bench/results/benchmarks.md and
leaves docs/ alone. `--before REF` adds llmfleet as of git revision REF to the relay
throughput and engine path comparisons (before/after figures of hot-path changes, from the
same run).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from bench import (affinity, cancel_latency, embeddings, engine_path, fair_share, gateway_capacity, migration, report,
                   routers)

PARTS = {
    "gateway": lambda args: gateway_capacity.main(["--quick"] * args.quick + (["--before", args.before]
                                                                             if args.before else [])),
    "engine": lambda args: engine_path.main(["--quick"] * args.quick + (["--before", args.before]
                                                                       if args.before else [])),
    "cancel": lambda args: cancel_latency.main(["--trials", "20" if args.quick else "100", "--load", "8"]),
    "fairness": lambda args: fair_share.main(["--quick"] * args.quick),
    "affinity": lambda args: affinity.main(["--quick"] * args.quick),
    "affinity-bounded": lambda args: affinity.main(["--cache-blocks", str(affinity.BOUNDED_CACHE_BLOCKS),
                                                    *["--quick"] * args.quick]),
    "affinity-vllm": lambda args: affinity.main(["--engine", "vllm", *["--quick"] * args.quick]),
    "embeddings": lambda args: embeddings.main(["--quick"] * args.quick),
    "routers": lambda args: routers.main(["--quick"] * args.quick),
    "migration": lambda args: migration.main(["--seconds", "30" if args.quick else "60"]),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run; the report stays in bench/results")
    parser.add_argument("--before", help="git revision to compare the hot path against (relay and engine path)")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: " + ", ".join(PARTS))
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    failed = []
    started = time.monotonic()
    for i, name in enumerate(parts, 1):
        sys.stderr.write(f"\n=== [{i}/{len(parts)}] {name} ({time.monotonic() - started:.0f}s elapsed) ===\n")
        try:
            PARTS[name](args)
        except Exception:  # noqa: BLE001 - one part failing must not lose the others' results
            traceback.print_exc()
            failed.append(name)
    path = report.write(quick=args.quick)
    sys.stderr.write(f"\nreport: {path} ({time.monotonic() - started:.0f}s in all)"
                     + (f"; FAILED: {', '.join(failed)}\n" if failed else "\n"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
