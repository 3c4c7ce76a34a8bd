"""``plan`` refuses, with ``up``'s line and exit 2, a model section ``up`` would refuse for its task
(:func:`worker.contract.tasks.check_task`), instead of planning a deployment that never starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from launcher.cli import app


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("{name: all-minilm-l6-v2, task: generate}", "is an encoder (bert), which has no LM head"),
        ("{name: all-minilm-l6-v2, task: embed, quantization: int8}", "quantization: int8 would be ignored"),
    ],
)
def test_plan_refuses_what_up_refuses_for_the_task(tmp_path, model, says):
    path = tmp_path / "deploy.yaml"
    path.write_text(f"model: {model}\nworkers: {{devices: cpu, replicas: 1}}\n")
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and says in result.output
