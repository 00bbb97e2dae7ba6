"""Profile the engine path: where the CPU beside the engine goes, vllm serve against llmfleet.

Starts `vllm serve` and llmfleet (Redis, a vLLM worker, a gateway) on the tiny model with the
same engine options (`bench.engine_path.Backends`), runs one `vllm bench serve` workload against
each, and samples the processes beside the engine with py-spy meanwhile: vllm serve's API
server; llmfleet's worker and gateway. Prints each process's CPU per output token and its
busiest functions; the raw stacks (flamegraph input) stay in bench/results/.

    python -m bench.profile_engine_path [--concurrency 8] [--prompts 64] [--top 25]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, cpu_seconds
from bench.engine_path import Backends, bench_serve, vllm_cli_env
from bench.profile_gateway import top_functions


def profile(name: str, url: str, pids: dict[str, int], model_dir: Path, workload: dict, env: dict,
            scratch: Path, top: int) -> list[str]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    slug = name.replace(" ", "_")
    spies = {proc: (RESULTS / f"engine_profile_{slug}_{proc}.txt") for proc in pids}
    running = [subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "100", "--gil", "--nonblocking", "-f", "raw",
                                 "-o", str(spies[proc])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for proc, pid in pids.items()]
    cpu_before = {proc: cpu_seconds(pid) for proc, pid in pids.items()}
    result = bench_serve(url, model_dir, workload, env, scratch / f"{slug}.json")
    cpu = {proc: cpu_seconds(pid) - cpu_before[proc] for proc, pid in pids.items()}
    for spy in running:
        spy.send_signal(2)  # py-spy writes its output on SIGINT
        spy.wait(timeout=60)
    tokens = result["completed"] * workload["output"]
    lines = [(f"## {name}: {result['output_throughput']:.0f} output tok/s, "
              f"TTFT p50 {result['p50_ttft_ms']:.1f} ms, ITL p50 {result['p50_itl_ms']:.2f} ms")]
    for proc in pids:
        lines += [f"\n### {name} / {proc}: {1000 * cpu[proc] / tokens:.3f} CPU ms per output token", "```",
                  top_functions(spies[proc], top), "```"]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    workload = {"input": 128, "output": 128, "concurrency": args.concurrency, "prompts": args.prompts}
    from worker.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="engine-profile-") as scratch, vllm_cli_env() as env, \
            Backends() as backends:
        model_dir = write_tiny_model(Path(scratch) / "tiny")
        urls = backends.start(model_dir, env, False, Path(scratch))
        warmup = {"input": 128, "output": 16, "concurrency": 4, "prompts": 8}
        for url in urls.values():
            bench_serve(url, model_dir, warmup, env, Path(scratch) / "warmup.json")
        worker, gateway, _redis = backends.frontends["llmfleet"]
        report = profile("vllm serve", urls["vllm serve"], {"api_server": backends.frontends["vllm serve"][0]},
                         model_dir, workload, env, Path(scratch), args.top)
        report += profile("llmfleet", urls["llmfleet"], {"worker": worker, "gateway": gateway}, model_dir,
                          workload, env, Path(scratch), args.top)
    print("\n".join(report))


if __name__ == "__main__":
    main()
