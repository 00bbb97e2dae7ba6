"""Where in its streams a server's slowest token gaps fall: vllm serve against llmfleet, by position.

Starts `vllm serve` and llmfleet (Redis, one vLLM worker, a gateway) on the tiny model with the same
engine options (`bench.engine_path.Backends`) and runs the same `vllm bench serve` workload (128 ->
128 tokens, `--save-detailed`) against each in alternating rounds. Each request's inter-token gaps
are split by where they fall in its stream: its first ten, its last ten, and the rest. In a closed
loop a request's first and last tokens come while other requests end and new ones are admitted
(their prompts parsed, rendered and prefilled on the same cores); its middle, while the running
streams only decode. Gap percentiles per region tell which of the two a tail comes from.

    python -m bench.itl_positions [--concurrency 128] [--prompts 512] [--rounds 4]

Writes bench/results/itl_positions.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, percentile, plot_bars, save
from bench.engine_path import Backends, bench_serve, vllm_cli_env

EDGE = 10  # gaps at each end of a stream counted as its first or last
REGIONS = ("first ten", "middle", "last ten")
SERVERS = ("vllm serve", "llmfleet")


def regions(itls: list[list[float]]) -> dict[str, list[float]]:
    """Every request's gaps (seconds), by where each falls in its stream."""
    split: dict[str, list[float]] = {region: [] for region in REGIONS}
    for gaps in itls:
        for index, gap in enumerate(gaps):
            region = "first ten" if index < EDGE else "last ten" if index >= len(gaps) - EDGE else "middle"
            split[region].append(gap)
    return split


def summary(result: dict) -> dict:
    """Throughput and gap percentiles (ms) of one detailed `vllm bench serve` result, overall and by region."""
    row = {"output_tok_s": result["output_throughput"], "itl_p99_ms": result["p99_itl_ms"]}
    for region, gaps in regions(result["itls"]).items():
        row[region] = {"gaps": len(gaps), "p50_ms": 1000 * percentile(gaps, 50), "p99_ms": 1000 * percentile(gaps, 99)}
    return row


def run(concurrency: int, prompts: int, rounds: int) -> dict:
    from worker.tiny_model import write_tiny_model

    workload = {"input": 128, "output": 128, "concurrency": concurrency, "prompts": prompts}
    runs = []
    with tempfile.TemporaryDirectory(prefix="itl-positions-") as scratch, vllm_cli_env() as env, \
            Backends() as backends:
        scratch = Path(scratch)
        model_dir = write_tiny_model(scratch / "tiny")
        urls = backends.start(model_dir, env, False, scratch)
        for url in urls.values():  # warm-up: first requests pay one-off costs
            bench_serve(url, model_dir, {"input": 128, "output": 16, "concurrency": 4, "prompts": 8}, env,
                        scratch / "warmup.json")
        for done in range(rounds):
            for name in SERVERS if done % 2 == 0 else reversed(SERVERS):
                result = bench_serve(urls[name], model_dir, workload, env, scratch / f"{done}.json", detailed=True)
                runs.append({"round": done, "server": name, **summary(result)})
                sys.stderr.write(f"round {done + 1}/{rounds}, {name}: {result['output_throughput']:.0f} tok/s\n")
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "workload": workload, "rounds": rounds, "runs": runs}


def medians(result: dict) -> dict[str, dict[str, float]]:
    """Per server, the median over rounds of each region's gap p99 (ms) and of the whole run's."""
    out = {}
    for server in SERVERS:
        rows = [row for row in result["runs"] if row["server"] == server]
        out[server] = {region: statistics.median(row[region]["p99_ms"] for row in rows) for region in REGIONS}
        out[server]["all"] = statistics.median(row["itl_p99_ms"] for row in rows)
    return out


def table(result: dict) -> str:
    lines = ["| round | server | output tok/s | ITL p99 ms | "
             + " | ".join(f"{region}: p50 / p99 ms" for region in REGIONS) + " |", "|---|---|---|---|---|---|---|"]
    for row in result["runs"]:
        cells = " | ".join(f"{row[region]['p50_ms']:.1f} / {row[region]['p99_ms']:.1f}" for region in REGIONS)
        lines.append(f"| {row['round'] + 1} | {row['server']} | {row['output_tok_s']:,.0f} | {row['itl_p99_ms']:.1f} | "
                     f"{cells} |")
    mid = medians(result)
    lines += ["", "Medians over the rounds of each gap p99 (ms), and llmfleet's less vllm serve's:", "",
              "| | whole stream | " + " | ".join(REGIONS) + " |", "|---|---|---|---|---|"]
    for server in SERVERS:
        lines.append(f"| {server} | {mid[server]['all']:.1f} | "
                     + " | ".join(f"{mid[server][region]:.1f}" for region in REGIONS) + " |")
    lines.append("| llmfleet − vllm serve | " + " | ".join(
        f"{mid['llmfleet'][key] - mid['vllm serve'][key]:+.1f}" for key in ("all", *REGIONS)) + " |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    mid = medians(result)
    panels = {f"gap p99, {region} (ms)": [mid[server][region] for server in SERVERS] for region in REGIONS}
    plot_bars(RESULTS / "itl_positions.png", list(SERVERS), panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    return save("itl_positions", run(args.concurrency, args.prompts, args.rounds), plot, table)


if __name__ == "__main__":
    main()
