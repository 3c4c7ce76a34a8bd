"""The session's keyed deployment: the one the access-control tests (``tests/e2e/test_security.py``)
and the pages' key, admin and ``kill -9`` tests (``tests/e2e/test_pages.py``) share, instead of
one each. Fixtures ``secured`` (``tests/helpers/fixtures.py``).

One replica (small KV: it runs beside the shared deployment); API keys from the environment,
overriding the file's ``file-key``; the admin token from the environment; a short
``router.request_timeout_s`` (the 504 and 408 tests wait for it); ``--log-format json``; a
3-second restart back-off (the status page shows a killed worker dead for that long). A test that
kills its worker waits for it to come back; every module gets it with its worker ready.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from tests.helpers.deployment import Deployment

ENV_KEYS = ["env-key-1", "env-key-2"]
FILE_KEY = "file-key"  # in deploy.yaml, overridden by LLAMADEPLOY_API_KEYS: never accepted
ADMIN_TOKEN = "admin-secret-token"
TIMEOUT_S = 10.0  # router.request_timeout_s: long enough for a page's short answer on a busy host


class SecuredDeployment(Deployment):
    """Authenticates with the environment's keys; lists its router and worker processes."""

    def __init__(self, tmp: Path):
        super().__init__(
            tmp,
            {
                "workers": {"replicas": 1, "kv_cache_gib": 0.25},
                "router": {"api_keys": [FILE_KEY], "request_timeout_s": TIMEOUT_S},
                "supervisor": {"restart_backoff_s": 3},
            },
            env={"LLAMADEPLOY_API_KEYS": ",".join(ENV_KEYS), "LLAMADEPLOY_ADMIN_TOKEN": ADMIN_TOKEN},
            args=["--log-format", "json"],
        )

    def auth_headers(self) -> dict:
        return {"Authorization": f"Bearer {ENV_KEYS[0]}"}

    def processes(self) -> dict[str, list[psutil.Process]]:
        procs = [psutil.Process(pid) for pid in self.child_pids()]
        return {
            "router": [p for p in procs if "router.main" in p.cmdline() and "--standby" not in p.cmdline()],
            "workers": [p for p in procs if "worker.main" in p.cmdline()],
        }
