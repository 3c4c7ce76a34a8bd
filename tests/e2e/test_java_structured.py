"""The JDK-only structured-output example (examples/java/StructuredOutput.java) against the
shared deployment; runs where ``java`` is on PATH."""

from __future__ import annotations

from tests.helpers.java import run_example


def test_java_structured_output_example_parses_the_answer(deployment):
    text = "Globex of Lyon opened a battery plant and hired 200 engineers."
    out = run_example("StructuredOutput.java", text, env={"LLAMADEPLOY_URL": deployment.base_url})
    lines = {k: v.strip() for k, _, v in (line.partition(":") for line in out.splitlines() if line)}
    assert set(lines) == {"name", "city", "keywords"}
    assert lines["name"] and len(lines["name"]) <= 40 and len(lines["city"]) <= 30
