"""The 100-document batch target of issue 32, on a deployment this script starts and breaks.

Usage: ``PYTHONPATH=. python scripts/batch_bench.py [deploy.yaml] [--port 8120] [--lines 100] [--output batch_bench]``
from the repository root. It starts ``llamadeploy up`` on the file (its ports moved to ``--port`` and
``--port + 1``, a fresh state folder), then, with ``--chat-clients`` closed-loop chat clients (the
mixed suite's: short questions, 48 tokens streamed):

1. the chat clients alone (``--alone-requests`` measured requests): TTFT p50/p95;
2. a batch of ``--lines`` summary lines through the official ``openai`` SDK
   (:mod:`launcher.bench.batch_suite`) while they chat: TTFT p50/p95 during the batch and its ratio
   to alone, and the batch's lines (every ``custom_id`` exactly once);
3. the same batch again with faults (unless ``--no-faults``): ``kill -9`` of the worker once 30 % of
   the lines are done, ``kill -9`` of the active router (the one listening on the port; the
   standby takes over) once 60 % are: every ``custom_id`` must still come back exactly once
   (``--faults-only`` skips 2).

Prints one JSON object (also written to ``OUTPUT.json``) and stops the deployment. Exit status 1
when a batch did not answer every ``custom_id`` exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import yaml

from launcher.bench.batch_suite import batch_input, check_output, run_batch
from launcher.bench.client import Client, served_model
from launcher.bench.load import closed_loop
from launcher.bench.mixed_figures import chat_figures
from launcher.bench.mixed_suite import chat_until
from launcher.bench.prompts import short_messages
from launcher.bench.summary import ratio

CHAT_TOKENS = 48


def start(config: Path, port: int, folder: Path) -> subprocess.Popen:
    """``llamadeploy up`` on ``config`` moved to ``port``/``port + 1`` with its state in ``folder``;
    returns once every worker is ready (the admin API's ``GET /admin/workers``; the process runs in
    its own session)."""
    cfg = yaml.safe_load(config.read_text()) or {}
    router = cfg.setdefault("router", {})
    router.update(port=port, admin_port=port + 1, state_dir=str(folder / "state"))
    (folder / "deploy.yaml").write_text(yaml.safe_dump(cfg))
    with open(folder / "up.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "up", str(folder / "deploy.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llamadeploy up exited with {proc.returncode}; see {folder / 'up.log'}")
        try:
            workers = httpx.get(f"http://127.0.0.1:{port + 1}/admin/workers", timeout=5).json()["workers"]
            if workers and all(w["state"] == "ready" for w in workers):
                return proc
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(2)
    raise SystemExit(f"the deployment was not ready within 900 s; see {folder / 'up.log'}")


def stop(proc: subprocess.Popen) -> None:
    """``llamadeploy down`` by signal (SIGTERM to the launcher), then SIGKILL to its session if it lingers."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Faults:
    """Called with the batch's share of lines done: ``kill -9`` of the worker at ``worker_at``, then
    of the router listening on ``port`` at ``router_at``; records when and which pid."""

    def __init__(self, port: int, worker_at: float = 0.3, router_at: float = 0.6):
        self.port, self.worker_at, self.router_at = port, worker_at, router_at
        self.done: list[dict] = []

    def __call__(self, share: float) -> None:
        if share >= self.worker_at and not self.done:
            workers = httpx.get(f"http://127.0.0.1:{self.port + 1}/admin/workers", timeout=10).json()["workers"]
            self._kill("worker", workers[0]["pid"], share)
        elif share >= self.router_at and len(self.done) == 1:
            listeners = [
                c.pid
                for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port and c.pid
            ]
            if listeners:
                self._kill("router", listeners[0], share)

    def _kill(self, what: str, pid: int, share: float) -> None:
        os.kill(pid, signal.SIGKILL)
        self.done.append({"killed": what, "pid": pid, "at_share_done": round(share, 2), "at": time.time()})


async def batch_beside_chat(args, chat: Client, model: str | None, faults: Faults | None) -> dict:
    """One batch of ``args.lines`` lines while the chat clients run; its figures and the chat's."""
    client = openai.AsyncOpenAI(base_url=args.url, api_key="none", max_retries=5, timeout=120)
    data = batch_input(model, args.lines, args.doc_chars, args.answer_tokens)
    done = asyncio.Event()
    chatting = asyncio.create_task(chat_until(chat, args.chat_clients, done, max_tokens=CHAT_TOKENS))
    try:
        run = await run_batch(client, data, faults)
    finally:
        done.set()
        beside = await chatting
        await client.close()
    out = {"batch": check_output(run, args.lines), "chat": chat_figures(beside, run.started, run.ended)}
    out["chat"]["errors_seen"] = sorted({s.error for s in beside if s.error})[:3]  # what the failures were
    out["wall_minus_perf_s"] = time.time() - time.perf_counter()  # dates the timelines' perf_counter times
    if faults is not None:
        out["faults"] = faults.done
    return out


async def workload(args) -> dict:
    """The three phases (module docstring) against the deployment at ``args.url``."""
    model = served_model(args.url, None)
    chat = Client(args.url, model, True, {}, None, 600)
    try:
        prompts = [short_messages("alone", i) for i in range(64)]
        n = args.chat_clients
        alone, a0, a1 = await closed_loop(chat, prompts, n, args.alone_requests, n, max_tokens=CHAT_TOKENS)
        result = {"chat_alone": chat_figures([s for s in alone if s.kind == "measured"], a0, a1)}
        if not args.faults_only:
            result["during_batch"] = await batch_beside_chat(args, chat, model, None)
            during = result["during_batch"]["chat"]["ttft_p95_s"]
            result["ttft_p95_during_batch_over_alone"] = ratio(during, result["chat_alone"]["ttft_p95_s"])
        if not args.no_faults:
            result["with_faults"] = await batch_beside_chat(args, chat, model, Faults(args.port))
    finally:
        await chat.close()
    return result


def interrupted(signum, _frame) -> None:
    """SIGTERM and SIGINT (ignored by default in a background job) end the run through ``finally``,
    so the deployment is stopped."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="deploy.yaml", type=Path)
    ap.add_argument("--port", type=int, default=8120, help="the endpoint's port (the admin API: the next one)")
    ap.add_argument("--lines", type=int, default=100, help="summary lines in each batch")
    ap.add_argument("--doc-chars", type=int, default=1500, help="characters of each document (~4 per token)")
    ap.add_argument("--answer-tokens", type=int, default=96, help="max_tokens of each summary")
    ap.add_argument("--chat-clients", type=int, default=4)
    ap.add_argument(
        "--alone-requests",
        type=int,
        default=64,
        help="measured chat requests alone (the ratio's denominator: 16 made its p95 move by half between runs)",
    )
    ap.add_argument("--no-faults", action="store_true", help="skip the third phase (kill -9 of worker and router)")
    ap.add_argument("--faults-only", action="store_true", help="skip the second phase (the batch without faults)")
    ap.add_argument("--output", type=Path, default=Path("batch_bench"))
    args = ap.parse_args()
    args.url = f"http://127.0.0.1:{args.port}/v1"
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as folder:
        began = time.perf_counter()
        proc = start(args.config, args.port, Path(folder))
        try:
            result = {"options": options, **asyncio.run(workload(args))}
        finally:
            stop(proc)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    text = json.dumps(result, indent=2, default=str)
    args.output.with_suffix(".json").write_text(text)
    sys.stdout.write(text + "\n")
    batches = [result[k] for k in ("during_batch", "with_faults") if k in result]
    return 0 if all(b["batch"]["every_custom_id_once"] for b in batches) else 1


if __name__ == "__main__":
    sys.exit(main())
