"""Start and stop a real ``llamadeploy up`` for tests: real processes, real sockets, real HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import yaml

from launcher.plan.ports import free_port

MODEL = "smollm2-135m-instruct"
T = TypeVar("T")
# `up` refuses to start when the machine has not the RAM its workers need now (launcher.plan.plan);
# under `pytest -n 2` the other worker's deployment (or another job) may hold it for a while
RAM_REFUSAL = "CPU workers need"
RAM_WAIT_S = 600.0  # how long start() retries such a refusal before failing with it
RAM_RETRY_S = 10.0


def wait_for(predicate: Callable[[], T], timeout: float, what: str = "", interval: float = 0.1) -> T:
    """Call ``predicate`` until it returns something truthy, and return that; raise
    ``TimeoutError`` (naming ``what`` and the last value) after ``timeout`` seconds.

    An ``httpx.HTTPError`` inside ``predicate`` counts as not yet (a server still starting).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            if value := predicate():
                return value
            last = value
        except httpx.HTTPError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not true within {timeout}s: {what or predicate} (last: {last!r:.500})")
        time.sleep(interval)


async def wait_for_async(predicate: Callable[[], T], timeout: float, what: str = "", interval: float = 0.01) -> T:
    """:func:`wait_for` for tests inside an event loop: sleeps without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not true within {timeout}s: {what or predicate} (last: {value!r:.500})")
        await asyncio.sleep(interval)
    return value


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


STANDBY = {"supervisor": {"router_standby": True}}  # a test deployment's config part for a module that kills its router


class Deployment:
    """One deployment in a temp folder. ``start()`` blocks until every worker is ready."""

    def __init__(self, tmp: Path, config: dict | None = None, env: dict | None = None, args: list[str] | None = None):
        self.tmp = Path(tmp)
        self.args = list(args or [])  # extra `llamadeploy up` flags
        self.port, self.admin_port = free_port(), free_port()
        base = {
            # float32: the tests compare outputs token for token across batching, chunking and prefix-cache
            # hits, which holds in float32 (bfloat16 rounds differently per matmul shape; docs/design/engine.md).
            # quantization none: float weights, the converted checkpoint, whose answers the tests assert
            # (tests/e2e/test_multimodel.py serves the GGUF file as stored)
            "model": {"name": MODEL, "max_model_len": 2048, "dtype": "float32", "quantization": "none"},
            # state_dir: the Batch API's database in the test's folder, not the user's ~/.local/state
            "router": {
                "port": self.port,
                "admin_port": self.admin_port,
                "request_timeout_s": 120,
                "state_dir": str(self.tmp / "state"),
            },
            "workers": {"devices": "cpu", "replicas": 2, "heartbeat_s": 0.5, "heartbeat_timeout_s": 10},
            # no standby router unless a module kills its router (STANDBY): each standby loads for seconds of CPU
            "supervisor": {"restart_backoff_s": 0.5, "shutdown_grace_s": 30, "router_standby": False},
        }
        self.config = deep_merge(base, config or {})
        if "models" in self.config:  # several models: the base model keys are each entry's defaults
            shared = self.config.pop("model")
            self.config["models"] = [{**shared, **entry} for entry in self.config["models"]]
        self.env = {**os.environ, **(env or {})}
        self.path = self.tmp / "deploy.yaml"
        self.log_path = self.tmp / "up.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def replicas(self) -> int:
        """Every model's replicas (an entry of ``models:`` may override ``workers.replicas``)."""
        top = self.config["workers"]["replicas"]
        entries = self.config.get("models") or [{}]
        return sum((entry.get("workers") or {}).get("replicas", top) for entry in entries)

    def start(self, timeout: float = 240.0) -> Deployment:
        """``llamadeploy up`` until every worker is ready (``timeout`` s). While ``up`` refuses for
        RAM the machine has not free now (:data:`RAM_REFUSAL`: another pytest-xdist worker's
        deployment holds it), it tries again every :data:`RAM_RETRY_S` for up to :data:`RAM_WAIT_S`,
        noting each wait in the log; any other failure raises at once."""
        self.path.write_text(yaml.safe_dump(self.config))
        cli = [sys.executable, "-m", "launcher.cli", "up", str(self.path), *self.args]
        waited_until = time.monotonic() + RAM_WAIT_S
        while True:
            self._log = open(self.log_path, "ab")  # closed by stop()
            attempt = self._log.tell()  # where this attempt's lines begin
            self.proc = subprocess.Popen(
                cli, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError:
                refused = RAM_REFUSAL in self.log_path.read_bytes()[attempt:].decode(errors="replace")
                if not refused or time.monotonic() > waited_until:
                    raise
            self._log.close()
            with open(self.log_path, "a") as log:
                log.write(f"[tests] up refused for RAM: trying again in {RAM_RETRY_S:.0f}s\n")
            time.sleep(RAM_RETRY_S)

    def wait_ready(self, timeout: float = 240.0, count: int | None = None) -> None:
        """Until ``count`` (default: all) workers are ready; fails at once if ``up`` exits."""
        want = self.replicas if count is None else count

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llamadeploy up exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            return sum(w["state"] == "ready" for w in self.workers()) >= want

        try:
            wait_for(ready, timeout, interval=0.5)
        except TimeoutError:
            raise TimeoutError(f"deployment not ready in {timeout}s:\n{self.log()[-4000:]}") from None

    def next_heartbeat(self, wid: int, timeout: float = 30.0) -> dict:
        """Worker ``wid``'s row once the router has taken a heartbeat from it after this call, so
        its load figures (running, peak, KV, memory) were reported after everything before it."""
        seen = self.worker(wid)["heartbeats"]
        return wait_for(
            lambda: (w := self.worker(wid))["heartbeats"] > seen and w, timeout, what=f"a heartbeat of worker {wid}"
        )

    def workers(self) -> list[dict]:
        r = httpx.get(f"{self.url}/workers", timeout=10, headers=self.auth_headers())
        r.raise_for_status()
        return r.json()["workers"]

    def worker(self, wid: int) -> dict:
        return next(w for w in self.workers() if w["id"] == wid)

    def auth_headers(self) -> dict:
        keys = self.config["router"].get("api_keys")
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def admin(self, method: str, path: str, json: dict | None = None, timeout: float = 120) -> httpx.Response:
        token = self.config["router"].get("admin_token")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.admin_url}{path}", json=json, timeout=timeout, headers=headers)

    def chat(self, content: str, timeout: float = 120, **kw) -> httpx.Response:
        """POST a one-message chat (greedy unless ``temperature`` is given)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
        return httpx.post(f"{self.base_url}/chat/completions", json=body, timeout=timeout, headers=self.auth_headers())

    def apply(self, extra: dict, *flags: str, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
        """Run ``llamadeploy apply`` with this deployment's config and ``extra`` merged in; on exit 0
        (not a dry run, not ``--rollback``) :attr:`config` becomes the new one. Returns the
        CompletedProcess (stdout and stderr together in ``stdout``), or the Popen with ``wait=False``."""
        new = deep_merge(self.config, extra)
        path = self.tmp / f"apply-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(new))
        cmd = [sys.executable, "-m", "launcher.cli", "apply", str(path), *flags]
        env = {**self.env, "COLUMNS": "400"}  # one printed line each, however long
        if not wait:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
        if done.returncode == 0 and "--dry-run" not in flags and "--rollback" not in flags:
            self.config = new
        return done

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def child_pids(self) -> list[int]:
        """Pids of the router and workers (from /workers and the launcher's process tree)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM the launcher and wait; SIGKILL everything left. Returns the launcher's exit code."""
        if self.proc is None:
            return 0
        children = self.child_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``llamadeploy <args>`` as a subprocess of this Python (the worktree's packages); its stdout
    and stderr as text, whatever its exit code (the test asserts it)."""
    cmd = [sys.executable, "-m", "launcher.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def all_ready_and_idle(d: Deployment) -> bool:
    return all(w["state"] == "ready" and w["in_flight"] == 0 and w["running"] == 0 for w in d.workers())


def assert_openai_error(got: httpx.Response | dict, code: str | None = None, status: int | None = None) -> dict:
    """Assert ``got`` (a response, or a body or SSE event already decoded) is an error in OpenAI's
    shape, ``{"error": {message, type, param, code}}`` with a message, of ``code`` (any when
    ``None``); a response also has ``status`` (when given) and the router's ``X-Request-ID``.
    Returns the inner error object."""
    if isinstance(got, httpx.Response):
        assert status is None or got.status_code == status, (got.status_code, got.text)
        assert got.headers.get("X-Request-ID"), got.headers
        got = got.json()
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
    err = got["error"]
    assert err["message"] and (code is None or err["code"] == code), err
    return err
