"""The command line's shared console helpers: where messages go, how a bad config ends the command.

Every command (``launcher.cli`` and ``launcher.bench``) uses these, so no package imports the CLI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from launcher.config import ConfigError, DeployConfig, load_config

console = Console(stderr=True, soft_wrap=True)  # messages and progress: stderr, so stdout stays data


def config_path(path: Path | None) -> Path | None:
    """``path``, or ./deploy.yaml when none is given and one is here, else ``None`` (the defaults)."""
    if path is None and Path("deploy.yaml").is_file():
        return Path("deploy.yaml")
    return path


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` as an error on stderr and end the command with exit ``code``."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # [ray] is text, not markup
    raise typer.Exit(code)


def load_or_exit(config: Path | None, overrides: dict | None = None) -> DeployConfig:
    """:func:`launcher.config.load_config`, or exit 2 with its message when the config is invalid:
    one ``error:`` line per problem, each naming the file and the key path, no traceback."""
    try:
        return load_config(config_path(config), overrides)
    except ConfigError as exc:
        fail_lines(str(exc).splitlines())


def fail_lines(lines: list[str], code: int = 2) -> None:
    """Print each of ``lines`` as an error line on stderr (one per problem) and exit ``code``."""
    for line in lines[:-1]:
        console.print(f"[bold red]error:[/] {escape(line)}", highlight=False)
    fail(lines[-1] if lines else "", code)


def report_console() -> Console:
    """stdout for tables: the terminal's width, or 160 columns when piped (rich would use 80)."""
    return Console(width=None if sys.stdout.isatty() else 160)
