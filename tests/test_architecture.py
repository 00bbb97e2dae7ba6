"""The architecture holds: import-linter's contracts ([tool.importlinter] in pyproject.toml).

Layers import only downwards (gateway: api -> serve -> http -> fleet; worker: main -> consumer ->
runner -> adapters), the gateway and the worker never import each other, `shared` (the wire)
imports neither them nor FastAPI, pydantic or vLLM, and no package's modules form a cycle.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "5 kept" in done.stdout, done.stdout[-2000:]
