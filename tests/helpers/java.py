"""Run the JDK-only examples under examples/java/ for the e2e tests: one source file each, no
build tool, no dependency (``java File.java`` compiles it in memory and runs it, JDK 11+)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples/java"


def run_example(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Compile and run ``examples/java/<name>`` (e.g. ``"Responses.java"``) with ``args`` and the
    environment plus ``env`` (e.g. ``{"LLAMADEPLOY_URL": deployment.base_url}``); return its stdout.

    Skips the calling test, saying why, when ``java`` is not on PATH; fails the test with the
    program's stderr when it exits non-zero; ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    java = shutil.which("java")
    if java is None:
        pytest.skip("java is not on PATH (the JDK-only examples need a JDK 11+)")
    out = subprocess.run(
        [java, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert out.returncode == 0, f"{name} exited with {out.returncode}:\n{out.stderr[-4000:]}"
    return out.stdout
