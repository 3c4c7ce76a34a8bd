"""Running the JDK-only examples (examples/java/*.java) against a deployment, where ``java`` is on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples/java"

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java is not on PATH")


def run_example(name: str, base_url: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``java examples/java/<name> args...`` (source-file mode) with ``LLAMADEPLOY_URL=base_url``;
    fails the test when it exits non-zero (its stderr shown). Returns the finished process."""
    out = subprocess.run(
        ["java", str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LLAMADEPLOY_URL": base_url, **(env or {})},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out
