"""A rich progress bar for ``llamadeploy up`` while the workers load the model.

The bar counts ready workers and names each one's state; a thread polls the router's admin API
(the only place the states live) while the launcher's main thread waits for readiness. It is shown
only on an interactive terminal with text logs: a log file or ``--log-format json`` stays clean.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def describe(workers: list[dict]) -> tuple[int, str]:
    """(ready count, ``"0 ready, 1 starting"``) from the admin API's worker entries."""
    ready = sum(w.get("state") == "ready" for w in workers)
    return ready, ", ".join(f"{w['id']} {w.get('state', '?')}" for w in sorted(workers, key=lambda w: w["id"]))


def make_progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]loading model[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("workers ready"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )


@contextmanager
def loading_progress(
    poll: Callable[[], dict | None],
    expected: int,
    enabled: bool = True,
    console: Console | None = None,
    interval_s: float = 0.5,
) -> Iterator[None]:
    """Show the bar while the ``with`` body runs; ``poll()`` returns ``GET /admin/workers`` or None."""
    console = console or Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield
        return
    done = threading.Event()
    with make_progress(console) as progress:
        task = progress.add_task("", total=expected)

        def update() -> None:
            while not done.wait(interval_s):
                info = poll()
                if info is not None:
                    ready, states = describe(info.get("workers", []))
                    progress.update(task, completed=ready, description=states)

        thread = threading.Thread(target=update, name="loading-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)
