"""The JDK-only structured-output example (examples/java/StructuredOutput.java) against the
shared deployment; runs where ``java`` is on PATH."""

from __future__ import annotations

from tests.helpers.java import needs_java, run_example


@needs_java
def test_java_structured_output_example_parses_the_answer(deployment):
    out = run_example(
        "StructuredOutput.java", deployment.base_url, "Globex of Lyon opened a battery plant and hired 200 engineers."
    )
    lines = {k: v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines() if line)}
    assert set(lines) == {"name", "city", "keywords"}
    assert lines["name"] and len(lines["name"]) <= 40 and len(lines["city"]) <= 30
