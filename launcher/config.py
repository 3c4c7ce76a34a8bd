"""deploy.yaml: the validated configuration of one deployment (one source of defaults).

Every section forbids unknown keys, so a misspelt key stops ``llamadeploy up`` with a message
naming it, instead of being silently ignored. :func:`load_config` is the only entry point; it
raises :class:`ConfigError` with one readable line per problem.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(
        DEFAULT_MODEL, description="alias of the embedded default, an HF id, a local HF folder, or a .gguf path"
    )
    served_name: str | None = Field(None, description="the `model` clients send; defaults to `name`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weight-only quantization of the linear layers: auto = a GGUF file's quantized tensors as "
        "stored, a float checkpoint unquantized; none = float weights (a GGUF file dequantized); int8 / int4 = "
        "quantize the float weights at load, per group (embeddings, norms and the LM head stay float)",
    )
    max_model_len: int = Field(2048, ge=16, le=1_048_576, description="prompt + completion tokens per request")
    random_init: bool = Field(
        False,
        description="for benchmarking only: build the model from config.json with "
        "random weights (no weight files needed); its answers are noise",
    )

    @property
    def public_name(self) -> str:
        return self.served_name or self.name


class RouterConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    policy: Literal["round_robin", "least_loaded"] = "least_loaded"
    admin_host: str = Field("127.0.0.1", description="the admin API listens here (loopback unless told otherwise)")
    admin_port: int = Field(8001, ge=1, le=65535)
    admin_token: str | None = Field(None, description="bearer token for the admin API; env LLAMADEPLOY_ADMIN_TOKEN")
    api_keys: list[str] = Field(
        default_factory=list, description="bearer keys for /v1/*; env LLAMADEPLOY_API_KEYS (comma-separated)"
    )
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
    zmq_address: str | None = Field(
        None, description="ZeroMQ endpoint workers connect to; default ipc:// in the run dir"
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
    def _no_empty_key(cls, v: list[str]) -> list[str]:
        if any(not k.strip() for k in v):
            raise ValueError("API keys must not be empty")
        return v

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


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host`` (loopback for a
    wildcard bind such as 0.0.0.0)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class WorkersConfig(Section):
    devices: Literal["auto", "cpu"] | list[int] = Field("auto", description="auto | cpu | physical GPU indices")
    replicas: Literal["auto"] | int = Field("auto", description="auto = one per GPU (one on CPU)")
    gpus_per_replica: int = Field(
        1, ge=1, le=64, description="GPUs per replica; >1 splits layers across them (not tensor parallel)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="ranks per replica, one per GPU (or CPU core set), each holding 1/N of every layer",
    )
    workers_per_gpu: int = Field(1, ge=1, le=16, description="small replicas sharing one GPU")
    max_num_seqs: int = Field(8, ge=1, le=1024, description="sequences decoded together in one batch")
    max_waiting: int = Field(
        64, ge=0, le=100_000, description="requests queued per worker before the router answers 429"
    )
    max_prefill_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="prompt tokens prefilled per engine step while others decode (auto: measured at start on "
        "CPU, 2048 on GPU)",
    )
    max_queue_wait_s: float = Field(
        120.0, gt=0, description="a queued request waits at most this for KV memory, then gets 503 with Retry-After"
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache budget per CPU worker, GiB")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="share of a GPU's memory a worker may use")
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="a silent worker is declared dead after this")
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a worker with work and no engine step for this long is declared dead"
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="a worker must be ready within this")

    @field_validator("replicas")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("replicas must be >= 1 or 'auto'")
        return v

    @model_validator(mode="after")
    def _one_split(self) -> WorkersConfig:
        if self.tensor_parallel_size > 1 and self.gpus_per_replica > 1:
            raise ValueError(
                f"workers.tensor_parallel_size={self.tensor_parallel_size} and workers.gpus_per_replica="
                f"{self.gpus_per_replica} are exclusive (tensor parallel or a layer split): set one of them to 1"
            )
        return self

    @property
    def gpus_per_slot(self) -> int:
        """GPUs one replica takes: ``tensor_parallel_size`` ranks or a ``gpus_per_replica`` layer split."""
        return max(self.tensor_parallel_size, self.gpus_per_replica)

    def prefill_budgets(self, on_gpu: bool) -> tuple[int, int]:
        """Prompt tokens one engine step computes while others decode, and when nothing decodes.
        ``auto``: on GPU 2048 and 8192; on CPU, where a prefill is compute-bound, 32 and 512, and the
        worker then measures the first (``worker.replica.calibrate_prefill_tokens``: the largest
        chunk that keeps a step within twice a decode step)."""
        if self.max_prefill_tokens == "auto":
            return (2048, 8192) if on_gpu else (32, 512)
        return self.max_prefill_tokens, self.max_prefill_tokens


class SupervisorConfig(Section):
    restart_backoff_s: float = Field(1.0, ge=0, description="first restart delay; doubles per crash, capped at 30 s")
    max_restarts: int = Field(
        5, ge=0, description="restarts allowed within restart_window_s; the next crash marks the worker failed"
    )
    restart_window_s: float = Field(300.0, gt=0)
    drain_timeout_s: float = Field(60.0, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, in-flight requests get this long to finish")
    router_standby: bool = Field(
        True, description="keep a loaded standby router that takes over at once when the router dies"
    )


class LimitsConfig(Section):
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1, description="defaults to max_model_len - 1")
    max_tokens: int = Field(4096, ge=1, description="ceiling on a request's max_tokens (the server-side cap)")
    max_stop_strings: int = Field(16, ge=0)
    max_stop_length: int = Field(256, ge=1)


class LoggingConfig(Section):
    format: Literal["text", "json"] = "text"
    level: Literal["debug", "info", "warning", "error"] = "info"


class ClusterConfig(Section):
    """Where workers run: this machine's processes (``local``) or actors on a Ray cluster (``ray``)."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local: worker processes on this machine; ray: one Ray actor per worker slot"
    )
    address: str = Field(
        "auto",
        description="the Ray cluster: auto (RAY_ADDRESS, else this machine's head), host:6379 or ray://host:10001",
    )
    router_host: str = Field(
        "auto",
        description="the address the router's ZeroMQ socket binds and workers on other nodes connect to; "
        "auto = this machine's address on the Ray cluster",
    )
    zmq_port: int = Field(8002, ge=1, le=65535, description="the router's ZeroMQ port with ray (open it to the nodes)")
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="memory per GPU where a node's NVML cannot be read (plan and up size with it)"
    )
    cpus_per_worker: int = Field(
        1, ge=1, le=1024, description="CPU cores Ray reserves per worker (a CPU replica computes on them)"
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="a worker's Ray placement must be granted within this, else it is failed"
    )


class DeployConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _ray_layout(self) -> DeployConfig:
        if self.cluster.backend != "ray":
            return self
        if self.router.zmq_address and self.router.zmq_address.startswith("ipc://"):
            raise ValueError(
                "router.zmq_address is ipc://, which workers on other nodes cannot reach: with cluster.backend: ray "
                "leave it unset (tcp:// on cluster.router_host:cluster.zmq_port) or give a tcp:// address"
            )
        if isinstance(self.workers.devices, list):
            raise ValueError(
                "workers.devices lists GPU indices, which name one machine's GPUs: with cluster.backend: ray "
                "use devices: auto (every GPU Ray offers) or cpu"
            )
        return self

    @model_validator(mode="after")
    def _tp_is_local(self) -> DeployConfig:
        if self.workers.tensor_parallel_size > 1 and self.cluster.backend == "ray":
            raise ValueError(
                "workers.tensor_parallel_size > 1 is not supported with cluster.backend: ray yet; "
                "set workers.tensor_parallel_size: 1 or cluster.backend: local"
            )
        return self


class ConfigError(Exception):
    """deploy.yaml is unreadable or invalid; ``str()`` names each bad key and how to fix it."""


SECRET_KEYS = frozenset({"api_keys", "admin_token"})


def _describe(err: dict, model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section: Any = model
        for part in err["loc"][:-1]:
            field = section.model_fields.get(str(part)) if isinstance(section, type) else None
            section = field.annotation if field is not None else None
        known = list(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
        guess = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else (f" (known keys: {', '.join(known)})" if known else "")
        return f"{loc}: unknown key{hint}"
    got = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own sentences, as written
    where = f"{loc}: " if loc else ""  # a check over the whole file names its keys itself
    if isinstance(got, dict) or any(str(p) in SECRET_KEYS for p in err["loc"]):
        return f"{where}{msg}"  # a whole section, or a secret: do not echo it
    return f"{where}{msg} (got {got!r})"


def parse_config(data: Any, source: str = "deploy.yaml") -> DeployConfig:
    """Validate a parsed YAML document. Raises :class:`ConfigError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (model, router, workers, ...)")
    try:
        return DeployConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e, DeployConfig) for e in _merge_union_errors(exc.errors(), DeployConfig)]
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None


def _union_key(err: dict, model: type[BaseModel]) -> tuple | None:
    """The config key of an error raised by one member of a union type, else None. Pydantic
    reports such a value once per member, its location ending in the member's tag
    (``workers.max_prefill_tokens.constrained-int``, ``....literal['auto']``)."""
    if err["type"] == "extra_forbidden":
        return None
    loc, section = tuple(err["loc"]), model
    for n, part in enumerate(loc):
        fields = section.model_fields if isinstance(section, type) and issubclass(section, BaseModel) else {}
        if str(part) not in fields:
            return loc[:n] if n and isinstance(part, str) and not fields else None
        section = fields[str(part)].annotation
    return None


def _merge_union_errors(errors: list[dict], model: type[BaseModel]) -> list[dict]:
    """One error per key: a value that matches no member of a union (``int >= 1 | 'auto'``)
    becomes one error whose message lists what each member would accept; a member's complaint
    about items of a list (``devices: [0, "x"]``) names their positions, once per message."""
    out: list[dict] = []
    by_key: dict[tuple, dict] = {}
    parts: dict[tuple, list[tuple[str, list[str]]]] = {}  # key -> (message, item positions) in order
    for err in errors:
        key = _union_key(err, model)
        if key is None:
            out.append(err)
            continue
        where = [str(p) for p in err["loc"][len(key) + 1 :]]  # past the member's tag: an item's position
        same = [p for p in parts.setdefault(key, []) if p[0] == err["msg"] and bool(p[1]) == bool(where)]
        if same:
            same[0][1].extend(where)
        else:
            parts[key].append((err["msg"], where))
        if key not in by_key:
            by_key[key] = {**err, "loc": key}
            out.append(by_key[key])
    for key, merged in by_key.items():
        said = [_said(m, w, first=n == 0) for n, (m, w) in enumerate(parts[key])]
        merged["msg"] = ", or ".join(said)
    return out


def _said(msg: str, where: list[str], first: bool) -> str:
    """One member's complaint within the merged sentence: ``item 1: input should be ...``."""
    if not where:
        return msg if first else msg[:1].lower() + msg[1:]
    return f"{'items' if len(where) > 1 else 'item'} {', '.join(where)}: {msg[:1].lower()}{msg[1:]}"


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> DeployConfig:
    """Read ``path`` (or defaults when ``None``), apply env and CLI ``overrides``, validate.

    ``overrides`` maps dotted keys (``"router.port"``) to values; ``None`` values are skipped.
    Environment: ``LLAMADEPLOY_API_KEYS`` (comma-separated) and ``LLAMADEPLOY_ADMIN_TOKEN``.
    """
    data: dict[str, Any] = {}
    source = str(path) if path else "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: no such file (copy deploy.yaml from the repository as a start)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        return parse_config(data, source)
    env = {
        "router.api_keys": [k.strip() for k in os.environ.get("LLAMADEPLOY_API_KEYS", "").split(",") if k.strip()]
        or None,
        "router.admin_token": os.environ.get("LLAMADEPLOY_ADMIN_TOKEN") or None,
    }
    for dotted, value in {**env, **(overrides or {})}.items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            break  # let validation report the malformed section
        target[key] = value
    return parse_config(data, source)
