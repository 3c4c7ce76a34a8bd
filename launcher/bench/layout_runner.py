"""Run ``llamadeploy bench --layouts``: each layout of :func:`launcher.bench.layouts.layout_runs`
as its own ``llamadeploy up`` (one at a time, on the same ports), the same scenarios against each,
then the table. A layout that cannot run here (too few GPUs) or fails to start is a row that
says why; the command still exits 0 once the table is printed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import typer
import yaml

from launcher.bench import load
from launcher.bench.client import Client
from launcher.bench.layouts import LayoutResult, LayoutRun, layout_runs, results_table
from launcher.bench.prompts import short_messages
from launcher.plan.ports import free_port

log = logging.getLogger(__name__)

SINGLE_REQUESTS = 5
CLIENTS = 8
STOP_TIMEOUT_S = 90.0


def deploy_config(base: dict, run: LayoutRun, port: int, admin_port: int) -> dict:
    """``base`` (a deploy.yaml as a dict) with the layout's worker keys and these ports."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    out.setdefault("workers", {}).update(run.workers)
    out.setdefault("router", {}).update({"port": port, "admin_port": admin_port})
    return out


class GpuPeak:
    """Samples NVML's used memory of GPUs ``indices`` every 0.2 s in a thread; ``peak`` is the
    largest seen on any of them (bytes), None without NVML."""

    def __init__(self, indices: list[int]):
        self.indices, self.peak, self._stop = indices, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 -- no NVML: the figure stays empty
            log.debug("no NVML for peak memory: %s", exc)
            return
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            while not self._stop.is_set():
                used = max(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles)
                self.peak = max(self.peak or 0, used)
                self._stop.wait(0.2)
        finally:
            pynvml.nvmlShutdown()


def measure(base_url: str, output_tokens: int, api_key: str | None) -> tuple[float, float]:
    """(median single-request latency s, output tokens/s of 8 closed-loop clients) at ``base_url``."""

    async def go() -> tuple[float, float]:
        client = Client(base_url, None, True, {"max_tokens": output_tokens}, api_key, 600.0)
        try:
            await load.one_after_another(client, [short_messages("warm", i) for i in range(2)], "warmup")
            singles = await load.one_after_another(
                client, [short_messages("single", i) for i in range(SINGLE_REQUESTS)], "single"
            )
            samples, start, end = await load.closed_loop(
                client, [short_messages("loop", i) for i in range(64)], CLIENTS, 4 * CLIENTS, CLIENTS
            )
        finally:
            await client.close()
        bad = [s.error for s in singles + samples if s.kind in ("single", "measured") and not s.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0]}")
        latencies = sorted(s.end - s.start for s in singles)
        measured = [s for s in samples if s.kind == "measured"]
        return latencies[len(latencies) // 2], sum(s.tokens for s in measured) / (end - start)

    return asyncio.run(go())


def run_one(run: LayoutRun, base: dict, work: Path, output_tokens: int, timeout_s: float) -> LayoutResult:
    """Deploy ``run``, wait until every worker is ready, measure, stop. Never raises."""
    from launcher.config import ConfigError, parse_config
    from launcher.plan.layouts import tp_refusal

    port, admin_port = free_port(), free_port()
    path = work / f"{run.name.replace(' ', '_').replace('×', 'x')}.yaml"
    cfg = deploy_config(base, run, port, admin_port)
    try:
        if problem := tp_refusal(parse_config(cfg, str(path))):
            return LayoutResult(run.name, note=f"not run: {problem}")
    except ConfigError as exc:
        return LayoutResult(run.name, note=f"not run: {exc}")
    path.write_text(yaml.safe_dump(cfg))
    log_path = path.with_suffix(".log")
    api_key = (cfg.get("router", {}).get("api_keys") or [None])[0]
    if isinstance(api_key, dict):  # a key with settings of its own ({key, service_tier})
        api_key = api_key.get("key")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "up", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with GpuPeak(run.workers.get("devices") or [0]) as peak:
            if problem := wait_ready(proc, f"http://127.0.0.1:{port}", timeout_s, api_key):
                return LayoutResult(run.name, peak_bytes=peak.peak, note=f"{problem} (log: {log_path})")
            latency, throughput = measure(f"http://127.0.0.1:{port}/v1", output_tokens, api_key)
        return LayoutResult(run.name, latency, throughput, peak.peak)
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        return LayoutResult(run.name, note=f"{exc} (log: {log_path})")
    finally:
        stop(proc)


def wait_ready(proc: subprocess.Popen, root: str, timeout_s: float, api_key: str | None) -> str:
    """ "" once every worker of the deployment is ready, else what went wrong."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"llamadeploy up exited with {proc.returncode}"
        try:
            workers = httpx.get(f"{root}/workers", timeout=5, headers=headers).json()["workers"]
            if workers and all(w["state"] == "ready" for w in workers):
                return ""
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    return f"not ready within {timeout_s:.0f}s"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its children), SIGKILL its process group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def gpu_count() -> int:
    """Whole GPUs this host's NVML lists and the launcher may use."""
    from launcher.plan.placement import discover, visible_gpus

    return len({g.index for g in visible_gpus(discover())})


def run_layouts(
    config: Path | None, gpus: int | None, output_tokens: int, output: Path, startup_timeout_s: float = 600.0
) -> list[LayoutResult]:
    """Run every layout this host can, print the table (stdout) and write ``OUTPUT.json``."""
    from launcher.console import report_console

    base = (yaml.safe_load(config.read_text()) if config else {}) or {}
    count = gpu_count()
    results = []
    work: Path | None = None
    for run in layout_runs(count, gpus):
        if run.skipped:
            results.append(LayoutResult(run.name, note=f"not run: {run.skipped}"))
            continue
        work = work or Path(tempfile.mkdtemp(prefix="bench-layouts-"))  # kept: each layout's log is there
        typer.echo(f"bench --layouts: {run.name} ({json.dumps(run.workers)}), logs in {work}", err=True)
        results.append(run_one(run, base, work, output_tokens, startup_timeout_s))
    report_console().print(results_table(results))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps([r.public() for r in results], indent=2))
    return results
