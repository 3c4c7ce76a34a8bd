"""Router process entry: ``python -m router.main --config RUN/router.json --model-path DIR --address ZMQ``
(``--model-path`` once per served model, in the settings' ``models`` order).

A serving router imports :mod:`router.serve` and runs it. A standby router (``--standby``) loads
the same (the imports, the tokenizers and the grammar compilers) on a thread at
:data:`STANDBY_NICE`, so that it takes what the workers leave of the cores (the supervisor also
waits for a quiet moment to start it: :mod:`launcher.supervise.standby`). The main thread, which
serves after the takeover, keeps the process's priority: Linux keeps a priority per thread, and an
unprivileged process cannot raise one again. This module imports only the standard library and
the torch-free contract, so that nothing heavy runs before that thread exists.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from router.args import RouterArgs
from worker.contract.lifeline import die_with_parent

log = logging.getLogger("router")

STANDBY_NICE = 10  # a standby router loads while the workers serve: it yields the CPU to them

T = TypeVar("T")


def on_lowered_thread(work: Callable[[], T], nice: int) -> T:
    """Run ``work()`` on a new thread whose priority is ``nice`` steps lower than the caller's
    (capped at 19), and return its result or raise its exception. The caller's thread, and the
    threads it starts later, keep their priority. Where the priority cannot be changed it runs
    at the caller's, said in the log."""
    out: dict[str, object] = {}

    def run() -> None:
        me = threading.get_native_id()
        try:  # this thread only (Linux: a thread is a task with a priority of its own)
            os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + nice, 19))
        except OSError as exc:
            log.debug("the standby's loading keeps the process's priority: %s", exc)
        try:
            out["value"] = work()
        except BaseException as exc:  # noqa: BLE001 (re-raised on the caller's thread)
            out["error"] = exc

    thread = threading.Thread(target=run, name="standby-load")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def wait_for_takeover() -> int | None:
    """A standby router's wait: the supervisor writes ``go <restarts>`` on its stdin when the
    router it stands in for has died. Returns that restart count, or None when stdin closes first."""
    word, _, count = sys.stdin.readline().strip().partition(" ")
    return int(count) if word == "go" and count.isdigit() else None


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # first: a launcher killed from here on takes this process with it
    args = RouterArgs.from_argv(argv)
    if not args.standby:
        from router import serve  # here, not at the top: a standby imports it on its lowered thread

        serve.serve(serve.read_settings(args.config), args)
        return

    def load():
        from router import serve  # on this thread: the imports are most of a router's start

        cfg = serve.read_settings(args.config)
        models = serve.load_models(cfg, list(args.model_paths))
        serve.build_grammar_checkers(models)
        return serve, cfg, models

    serve, cfg, models = on_lowered_thread(load, STANDBY_NICE)
    log.info("standby router loaded; waiting to take over")
    restarts = wait_for_takeover()
    if restarts is None:
        log.info("standby router not needed; exiting")
        return
    log.info("standby router taking over (restart %d)", restarts)
    serve.serve(cfg, args, models, restarts)


if __name__ == "__main__":
    main()
