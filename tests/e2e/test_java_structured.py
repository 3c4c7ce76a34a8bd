"""The JDK-only structured-output example (examples/java/StructuredOutput.java) against the
shared deployment; runs where ``java`` is on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/java/StructuredOutput.java"


@pytest.mark.skipif(shutil.which("java") is None, reason="java is not on PATH")
def test_java_structured_output_example_parses_the_answer(deployment):
    env = {**os.environ, "LLAMADEPLOY_URL": deployment.base_url}
    out = subprocess.run(
        ["java", str(EXAMPLE), "Globex of Lyon opened a battery plant and hired 200 engineers."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = {k: v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines() if line)}
    assert set(lines) == {"name", "city", "keywords"}
    assert lines["name"] and len(lines["name"]) <= 40 and len(lines["city"]) <= 30
