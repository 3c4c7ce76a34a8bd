"""The docs' generated reference pages match the code: every deploy.yaml key and every CLI option.

``scripts/gen_reference.py`` writes ``docs/reference/configuration.md`` and ``docs/reference/cli.md``;
when a change adds a key or an option without running it again, the first test fails and says the
command that mends it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel, Field, create_model

import launcher.config
from launcher.cli import app
from launcher.config import DeployConfig
from worker.contract.settings import WorkersConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = ".venv/bin/python scripts/gen_reference.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gen_reference"]


def test_the_reference_pages_are_what_the_code_generates(gen):
    stale = [str(p.relative_to(ROOT)) for p in gen.stale_pages()]
    assert not stale, f"{stale} differ from the code: run `{REGENERATE}` and commit the pages"


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        sub = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if sub is not None:
            keys += leaf_keys(sub, f"{prefix}{name}.")
        elif name != "models":
            keys.append(f"{prefix}{name}")
    return keys


def test_every_deploy_yaml_key_is_listed(gen):
    page = gen.render_config()
    keys = leaf_keys(DeployConfig)
    assert len(keys) > 50
    missing = [k for k in keys if f"| `{k}` |" not in page and f"## `{k}[]`" not in page]  # [], a list of entries
    assert not missing
    for entry_key in ("models[].name", "models[].quantization"):  # the list's entries, too
        assert f"| `{entry_key}` |" in page


def test_every_command_and_option_is_listed(gen):
    page = gen.render_cli()
    group = typer.main.get_command(app)
    assert {"up", "status", "restart-worker", "apply", "plan", "doctor", "bench"} <= set(group.commands)
    for name, command in group.commands.items():
        assert f"## `llamadeploy {name}`" in page
        for param in command.params:
            shown = f"`{param.name.upper()}`" if param.param_type_name == "argument" else f"`{param.opts[0]}`"
            assert shown in page, (name, param.name)


def test_a_new_key_without_regenerating_makes_the_pages_stale(gen, monkeypatch):
    workers = create_model(
        "WorkersWithMore",
        __base__=WorkersConfig,
        spare_slots=(int, Field(2, ge=0, description="replicas started ahead of need")),
    )
    more = create_model("DeployWithMore", __base__=DeployConfig, workers=(workers, Field(default_factory=workers)))
    monkeypatch.setattr(launcher.config, "DeployConfig", more)
    assert "| `workers.spare_slots` | int | `2` | ≥ 0 | replicas started ahead of need |" in gen.render_config()
    assert gen.CONFIG_PAGE in gen.stale_pages()


def test_types_and_defaults_read_as_yaml(gen):
    fields = WorkersConfig.model_fields
    assert gen.type_name(fields["devices"].annotation) == "`auto` \\| `cpu` \\| list of int"
    assert gen.type_name(fields["max_prefill_tokens"].annotation) == "int \\| `auto`"
    assert gen.bounds(fields["max_prefill_tokens"]) == "≥ 1"
    assert gen.default_text(fields["replicas"]) == "`auto`"
    assert gen.default_text(DeployConfig.model_fields["router"]) == ""  # a section: its keys have defaults
