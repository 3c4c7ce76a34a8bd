"""A file ``up`` refuses is one line per problem, naming the key path, exit 2 and no traceback,
for every command that reads deploy.yaml (``up``, ``plan``, ``doctor``, ``apply``: the case list
``up``'s own tests use, :mod:`tests.helpers.refusals`)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from launcher import cli
from launcher.config import ConfigError, parse_config
from tests.helpers.refusals import FILE_REFUSALS, case_id


@pytest.mark.parametrize("data, line", FILE_REFUSALS, ids=[case_id(c) for c in FILE_REFUSALS])
def test_a_refused_file_is_one_line_naming_the_file_and_the_key(data, line):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "deploy.yaml")
    assert e.value.problems == [line]
    assert str(e.value) == f"deploy.yaml: {line}"


def test_several_problems_are_one_line_each():
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"port": 70000, "policy": "random"}}, "d.yaml")
    assert [line.split(":")[:2] for line in str(e.value).splitlines()] == [
        ["d.yaml", " router.port"],
        ["d.yaml", " router.policy"],
    ]


@pytest.mark.parametrize("command", ["up", "plan", "doctor", "apply"])
@pytest.mark.parametrize("data, line", FILE_REFUSALS, ids=[case_id(c) for c in FILE_REFUSALS])
def test_every_command_refuses_a_bad_file_in_one_line_with_exit_2(tmp_path, command, data, line):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli.app, [command, str(path)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    said = [x for x in result.stderr.splitlines() if x.strip()]
    verdict = "refused" if command == "apply" else "error"
    assert said[0] == f"{verdict}: {path}: {line}", said
    assert said[1:] == (["(nothing changed)"] if command == "apply" else []), said
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "text, says",
    [
        ("workers: [\n", "not valid YAML: line 2, column 1: while parsing a flow node; expected the node content"),
        ("workers:\n\treplicas: 1\n", "not valid YAML: line 2, column 1: "),
    ],
)
def test_invalid_yaml_is_one_line_with_its_place(tmp_path, text, says):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cli.app, ["up", str(path)])
    assert result.exit_code == 2
    (said,) = result.stderr.splitlines()
    assert said.startswith(f"error: {path}: {says}"), said


def test_a_file_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    result = CliRunner().invoke(cli.app, ["plan", str(path)])
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {path}: not UTF-8 text (byte 0): is it the deploy.yaml file?"
    ]


def test_up_of_a_directory_says_so_in_one_line(tmp_path):
    result = CliRunner().invoke(cli.app, ["up", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}: is a directory; give the deploy.yaml file itself (such as {tmp_path / 'deploy.yaml'})"
    ]
