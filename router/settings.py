"""The router's settings: the ``router`` and ``limits`` sections of deploy.yaml, and :class:`RouterSettings`.

:class:`RouterSettings` is all a router process receives (its run dir's settings file): its own
sections, the model and worker-health figures it applies, how to log, and the drain and shutdown
times the supervisor gives it.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from router.auth import token_matches
from router.hold import DEFAULT_HOLD_S
from router.policies.registry import PolicyName, describe_policies
from router.schemas import ServiceTier
from worker.contract.settings import LoggingConfig, ModelConfig, Section, WorkersConfig


class ApiKey(Section):
    """An API key with settings of its own: ``service_tier`` is the tier of its requests that name
    none (``flex``: a batch-only key whose requests may wait)."""

    key: str = Field(..., min_length=1, description="the bearer token")
    service_tier: ServiceTier = Field(
        "auto", description="the tier of this key's requests that name none (flex: may wait; a batch-only key)"
    )


class BatchConfig(Section):
    """The Batch API's bounds (:mod:`router.batch`). OpenAI's: 200 MB and 50,000 requests a file."""

    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="an uploaded file's size limit")
    max_lines: int = Field(50_000, ge=1, description="requests in one batch input file")
    running: int = Field(8, ge=1, le=1024, description="batch lines in flight at once (all batches together)")
    retention_days: float = Field(
        30.0, gt=0, description="files and finished batches are deleted this long after they were created"
    )


class RouterConfig(Section):
    host: str = Field("127.0.0.1", description="the public endpoint's address; 0.0.0.0 serves other machines")
    port: int = Field(
        8000, ge=1, le=65535, description="the public endpoint's port (the OpenAI API, the pages, /docs/)"
    )
    policy: PolicyName = Field("least_loaded", description=describe_policies())
    admin_host: str = Field("127.0.0.1", description="the admin API listens here (loopback unless told otherwise)")
    admin_port: int = Field(8001, ge=1, le=65535, description="the admin API's port (drain, restart, policy, apply)")
    admin_token: str | None = Field(None, description="bearer token for the admin API; env LLAMADEPLOY_ADMIN_TOKEN")
    api_keys: list[str | ApiKey] = Field(
        default_factory=list,
        description="bearer keys for /v1/*, each a string or {key, service_tier}; "
        "env LLAMADEPLOY_API_KEYS (comma-separated)",
    )
    state_dir: str | None = Field(
        None,
        description="where batches and their files are kept across restarts; "
        "default $XDG_STATE_HOME/llamadeploy/<port> (~/.local/state/...)",
    )
    batch: BatchConfig = Field(default_factory=BatchConfig)
    request_timeout_s: float = Field(300.0, gt=0, description="an accepted request ends within this, or gets 504")
    max_retries: int = Field(
        1, ge=0, le=5, description="retries on another worker when one is lost before any token was sent"
    )
    max_migrations: int = Field(
        3,
        ge=0,
        le=100,
        description="moves of a request whose worker is lost mid-generation "
        "to another worker, resuming after the generated tokens; 0 = off",
    )
    hold_s: float = Field(
        DEFAULT_HOLD_S,
        ge=0,
        description="a request that finds no ready replica of its model waits up to this long while one is "
        "expected (restarting, loading, being replaced), then gets 503; 0 = answer 503 at once",
    )
    zmq_address: str | None = Field(
        None,
        description="ZeroMQ endpoint workers connect to; default ipc:// in the run dir; tcp://HOST:PORT turns on "
        "CURVE with per-deployment keys",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="an idle keep-alive connection is closed after this; "
        "client pools should drop idle connections sooner",
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open public connections before new ones get 503; default: the open-file limit less a reserve",
    )

    @field_validator("api_keys")
    @classmethod
    def _no_empty_key(cls, v: list[str | ApiKey]) -> list[str | ApiKey]:
        if any(not (k if isinstance(k, str) else k.key).strip() for k in v):
            raise ValueError("API keys must not be empty")
        return v

    def key_secrets(self) -> list[str]:
        """Every API key's secret (what the auth middleware compares a bearer token with)."""
        return [k if isinstance(k, str) else k.key for k in self.api_keys]

    def key_tier(self, token: str) -> str | None:
        """The ``service_tier`` configured for the key ``token`` (None: a plain key, or no such key);
        compared in constant time like the keys themselves."""
        tier = None
        for k in self.api_keys:
            if isinstance(k, ApiKey) and token_matches(token, [k.key]):
                tier = k.service_tier
        return tier

    def state_path(self) -> Path:
        """The folder that keeps what outlives the deployment's processes (the Batch API's database)."""
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        return Path(base) / "llamadeploy" / str(self.port)

    @field_validator("zmq_address")
    @classmethod
    def _zmq_scheme(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith(("ipc://", "tcp://")) and len(v) > 6):
            raise ValueError("must be ipc://PATH or tcp://HOST:PORT")
        return v

    @model_validator(mode="after")
    def _admin_exposed(self) -> RouterConfig:
        if not is_loopback(self.admin_host) and not self.admin_token:
            raise ValueError(
                f"admin_host {self.admin_host!r} is not loopback: set router.admin_token "
                "(or LLAMADEPLOY_ADMIN_TOKEN) before exposing the admin API"
            )
        if self.port == self.admin_port and (
            self.host == self.admin_host or self.host in WILDCARD_HOSTS or self.admin_host in WILDCARD_HOSTS
        ):
            raise ValueError(
                f"port and admin_port are both {self.port}: the public API and the admin API "
                "need different ports; change one of them"
            )
        return self

    @property
    def admin_url(self) -> str:
        """Where a client on this machine reaches the admin API."""
        return f"http://{connect_host(self.admin_host)}:{self.admin_port}"


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def deployment_id(router: RouterConfig, served: list[str]) -> str:
    """A deployment's id: its listening addresses and served model names, hashed (12 hex digits).
    The router answers it on ``/health/live``; ``doctor`` computes it from deploy.yaml to tell a
    port held by this same deployment from one held by something else."""
    import hashlib

    key = [router.host, router.port, router.admin_host, router.admin_port, sorted(served)]
    return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host`` (loopback for a
    wildcard bind such as 0.0.0.0)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class LimitsConfig(Section):
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longer prompts get 400; default and ceiling: each model's max_model_len - 1"
    )
    max_tokens: int = Field(4096, ge=1, description="ceiling on a request's max_tokens (the server-side cap)")
    max_stop_strings: int = Field(16, ge=0, description="most strings in a request's stop")
    max_stop_length: int = Field(256, ge=1, description="longest stop string, characters")


class DrainSettings(Section):
    """How long the router lets a drained worker, and itself on SIGTERM, finish in-flight requests
    (``supervisor.drain_timeout_s`` and ``supervisor.shutdown_grace_s``)."""

    drain_timeout_s: float = Field(60.0, gt=0, description="how long a drain waits for in-flight requests")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, in-flight requests get this long to finish")


class RouterSettings(Section):
    """What the router process is told; its secrets (``router.api_keys``, ``router.admin_token``)
    reach no other child."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    models: list[ModelConfig] = Field(
        default_factory=list, description="every served model, in deploy.yaml's order ([]: `model` alone)"
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    model_workers: dict[str, WorkersConfig] = Field(
        default_factory=dict,
        description="served name -> the workers section that model runs under (its models: entry's keys over "
        "the top-level one); {}: every worker runs under `workers`",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    supervisor: DrainSettings = Field(default_factory=DrainSettings)

    def workers_for(self, model: str) -> WorkersConfig:
        """The workers section a worker of ``model`` (a served name) runs under: the one place the
        router looks a per-model key up (heartbeat and stall timeouts...)."""
        return self.model_workers.get(model, self.workers)

    def hold_limits(self, model: str | None) -> tuple[float, int]:
        """(``router.hold_s``, the model's ``workers.max_waiting``): how long and how many requests
        the router holds for a replica of ``model`` (None: the only one; :mod:`router.hold`)."""
        return self.router.hold_s, self.workers_for(model or "").max_waiting

    def model_timeouts(self) -> dict[str, tuple[float, float]]:
        """Served name -> (heartbeat, stall) timeouts in seconds of each model with its own workers
        section (what :class:`router.workers.WorkerPool` judges that model's workers by)."""
        timeouts = {}
        for name in self.model_workers:
            w = self.workers_for(name)
            timeouts[name] = (w.heartbeat_timeout_s, w.stall_timeout_s)
        return timeouts
