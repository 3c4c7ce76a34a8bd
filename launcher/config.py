"""deploy.yaml: the validated configuration of one deployment (one source of defaults).

Every section forbids unknown keys, so a misspelt key stops ``llamadeploy up`` with a message
naming it, instead of being silently ignored. :func:`load_config` is the only entry point; it
raises :class:`ConfigError` with one readable line per problem.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from router.settings import DrainSettings, LimitsConfig, RouterConfig, RouterSettings
from worker.contract.env import ADMIN_TOKEN_ENV, API_KEYS_ENV
from worker.contract.settings import LoggingConfig, ModelConfig, Section, WorkersConfig, WorkerSettings


class SupervisorConfig(DrainSettings):
    """How the supervisor restarts crashed children (and, inherited, the drain times the router applies)."""

    restart_backoff_s: float = Field(1.0, ge=0, description="first restart delay; doubles per crash, capped at 30 s")
    max_restarts: int = Field(
        5, ge=0, description="restarts allowed within restart_window_s; the next crash marks the worker failed"
    )
    restart_window_s: float = Field(300.0, gt=0, description="the window max_restarts counts crashes in")
    router_standby: bool = Field(
        True,
        description="keep a loaded standby router that takes over at once when the router dies (it loads "
        "at the first second without a request in flight, or after 10 minutes; costs one router's memory; "
        "off: a restart loads from scratch, some seconds)",
    )


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
        "auto = this machine's address on the Ray cluster; one the nodes cannot reach (0.0.0.0, loopback with "
        "nodes elsewhere) is refused",
    )
    zmq_port: int = Field(8002, ge=1, le=65535, description="the router's ZeroMQ port with ray (open it to the nodes)")
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="memory per GPU where a node's NVML cannot be read; without it up skips the memory plan and "
        "plan refuses",
    )
    cpus_per_worker: int = Field(
        1, ge=1, le=1024, description="CPU cores Ray reserves per worker (a CPU replica computes on them)"
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a worker's Ray placement must be granted within this, else the slot is failed; its actor must "
        "start within it, else that start counts as a crash",
    )


class ModelEntry(ModelConfig):
    """One entry of deploy.yaml's ``models:`` list: every key of the ``model:`` section, and a
    ``workers:`` section whose keys override the top-level ``workers:`` for this model only."""

    workers: WorkersConfig | None = Field(
        None, description="keys given here override the top-level workers section for this model"
    )

    def model_section(self) -> ModelConfig:
        """The entry as a ``model:`` section (without its ``workers`` override)."""
        return ModelConfig.model_validate(self.model_dump(exclude={"workers"}))


@dataclass(frozen=True)
class Served:
    """One model of a deployment: its ``model`` section and the ``workers`` section it runs under
    (the top-level one with the entry's own keys over it)."""

    model: ModelConfig
    workers: WorkersConfig

    @property
    def name(self) -> str:
        return self.model.public_name


class DeployConfig(Section):
    """The whole deploy.yaml: each role's sections, composed. A child process gets only its own
    settings (:meth:`worker_settings`, :meth:`router_settings`).

    Several models: a ``models:`` list instead of ``model:`` (:meth:`served`); ``model`` is then
    the first entry, the one a request without ``model`` goes to when it generates."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    models: list[ModelEntry] | None = Field(
        None, min_length=1, description="several models behind one endpoint (instead of model:)"
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    def served(self) -> list[Served]:
        """Every model this deployment serves, in deploy.yaml's order: the ``models:`` entries, or
        the one ``model:`` section under the top-level ``workers:``."""
        if not self.models:
            return [Served(self.model, self.workers)]
        return [Served(e.model_section(), merged_workers(self.workers, e.workers)) for e in self.models]

    def workers_for(self, name: str) -> WorkersConfig:
        """The workers section model ``name`` (a served name) runs under; the top-level one for a
        name not served (a worker that has not said its model yet)."""
        return next((one.workers for one in self.served() if one.name == name), self.workers)

    def for_model(self, index: int) -> DeployConfig:
        """This config as if model ``index`` of :meth:`served` were its only one (``model`` and
        ``workers`` replaced; not validated again): what the one-model plan and checks read."""
        one = self.served()[index]
        return self.model_copy(update={"model": one.model, "workers": one.workers, "models": None})

    def worker_settings(self, index: int = 0) -> WorkerSettings:
        """What a worker of model ``index`` (of :meth:`served`) receives: no router secret is in it."""
        one = self.served()[index]
        return WorkerSettings(model=one.model, workers=one.workers, logging=self.logging)

    def router_settings(self) -> RouterSettings:
        """What the router process receives."""
        drain = DrainSettings.model_validate(self.supervisor.model_dump(include=set(DrainSettings.model_fields)))
        return RouterSettings(
            model=self.model,
            models=[m.model for m in self.served()] if self.models else [],
            model_workers={m.name: m.workers for m in self.served()} if self.models else {},
            router=self.router,
            workers=self.workers,
            limits=self.limits,
            logging=self.logging,
            supervisor=drain,
        )

    @model_validator(mode="after")
    def _one_form(self) -> DeployConfig:
        if self.models is None:
            return self
        if "model" in self.model_fields_set:
            raise ValueError("give either model: (one model) or models: (a list), not both")
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.models):
            if (first := seen.setdefault(entry.public_name, i)) != i:
                raise ValueError(
                    f"models[{first}] and models[{i}] are both served as '{entry.public_name}': "
                    "give one of them another served_name"
                )
        for i, entry in enumerate(self.models):
            if entry.workers is not None:
                try:
                    merged_workers(self.workers, entry.workers)
                except ValidationError as exc:
                    said = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                    raise ValueError(f"models[{i}].workers: {said}") from None
        self.__dict__["model"] = self.models[0].model_section()  # not an assignment: no re-validation
        return self

    @model_validator(mode="after")
    def _ray_layout(self) -> DeployConfig:
        if self.cluster.backend != "ray":
            return self
        if self.router.zmq_address and self.router.zmq_address.startswith("ipc://"):
            raise ValueError(
                "router.zmq_address is ipc://, which workers on other nodes cannot reach: with cluster.backend: ray "
                "leave it unset (tcp:// on cluster.router_host:cluster.zmq_port) or give a tcp:// address"
            )
        if self.models is not None and len(self.models) > 1:
            raise ValueError(
                "models: lists several models, which cluster.backend: ray does not serve yet; "
                "use cluster.backend: local, or one model"
            )
        if any(isinstance(one.workers.devices, list) for one in self.served()):
            raise ValueError(
                "workers.devices lists GPU indices, which name one machine's GPUs: with cluster.backend: ray "
                "use devices: auto (every GPU Ray offers) or cpu"
            )
        return self

    @model_validator(mode="after")
    def _tp_is_local(self) -> DeployConfig:
        tp = max(one.workers.tensor_parallel_size for one in self.served())
        if tp > 1 and self.cluster.backend == "ray":
            raise ValueError(
                "workers.tensor_parallel_size > 1 is not supported with cluster.backend: ray yet; "
                "set workers.tensor_parallel_size: 1 or cluster.backend: local"
            )
        return self


def merged_workers(top: WorkersConfig, override: WorkersConfig | None) -> WorkersConfig:
    """``top`` with the keys ``override`` was given explicitly over it. Raises pydantic's
    ``ValidationError`` when the two together break a rule (tensor parallel and a layer split)."""
    if override is None:
        return top
    given = override.model_dump(include=override.model_fields_set)
    return WorkersConfig.model_validate({**top.model_dump(include=top.model_fields_set), **given})


class ConfigError(Exception):
    """deploy.yaml is unreadable or invalid. ``problems``: one line per problem, each naming the
    key path and the fix; ``str()``: those lines, each prefixed with the file (``source``), so a
    file with one problem is one line (``deploy.yaml: workers.replicas: ...``)."""

    def __init__(self, source: str, *problems: str):
        self.source, self.problems = source, list(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


SECRET_KEYS = frozenset({"api_keys", "admin_token"})


def key_path(loc: tuple | list) -> str:
    """A location in deploy.yaml as every message spells it: keys joined by dots, list items by
    their index in brackets (``models[1].workers.replicas``)."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _describe(err: dict, model: type[BaseModel]) -> str:
    loc = key_path(err["loc"])
    if err["type"] == "extra_forbidden":
        section: Any = model
        for part in err["loc"][:-1]:
            if isinstance(part, int):
                continue  # an item of a list: its section is the list's item type
            field = section.model_fields.get(str(part)) if isinstance(section, type) else None
            section = section_type(field.annotation) if field is not None else None
        known = list(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
        guess = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else (f" (known keys: {', '.join(known)})" if known else "")
        return f"{loc}: unknown key{hint}"
    got = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own sentences, as written
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):  # pydantic names its classes
        named = err["loc"] in (("model",), ("models",)) or (len(err["loc"]) == 2 and err["loc"][0] == "models")
        msg = "a section is needed: a mapping of its keys" + (" (or the model's name)" if named else "")
    where = f"{loc}: " if loc else ""  # a check over the whole file names its keys itself
    if isinstance(got, dict) or any(str(p) in SECRET_KEYS for p in err["loc"]):
        return f"{where}{msg}"  # a whole section, or a secret: do not echo it
    return f"{where}{msg} (got {got!r})"


def section_type(annotation: Any) -> Any:
    """The section class inside ``annotation``: itself, or the model in ``list[M] | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := section_type(arg)) is not None:
            return found
    return None


def parse_config(data: Any, source: str = "deploy.yaml") -> DeployConfig:
    """Validate a parsed YAML document. ``model: NAME`` (a string, as Ollama users write it) is
    ``model: {name: NAME}``, and so is a ``models:`` entry given as a string. Raises
    :class:`ConfigError`, also for a number written as a string (``replicas: "2"``), which
    pydantic would otherwise take."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, "the top level must be a mapping of sections (model, router, workers, ...)")
    data = _named_models(data)
    lines = quoted_numbers(data, DeployConfig)
    try:
        cfg = DeployConfig.model_validate(data)
    except ValidationError as exc:
        lines += [_describe(e, DeployConfig) for e in _merge_union_errors(exc.errors(), DeployConfig)]
    if not lines:
        return cfg
    raise ConfigError(source, *lines) from None


def _named_models(data: dict) -> dict:
    """``model: NAME`` as ``model: {name: NAME}``; each ``models:`` entry given as a string likewise."""
    out = dict(data)
    if isinstance(out.get("model"), str):
        out["model"] = {"name": out["model"]}
    if isinstance(out.get("models"), list):
        out["models"] = [{"name": e} if isinstance(e, str) else e for e in out["models"]]
    return out


def quoted_numbers(data: Any, section: Any, loc: tuple = ()) -> list[str]:
    """One line per number written as a string (``replicas: "2"``) where ``section`` (a config
    class) takes a number and no string but the words it names (``auto``): refused like any other
    wrong type, where pydantic's lax mode would convert it."""
    if not (isinstance(data, dict) and isinstance(section, type) and issubclass(section, BaseModel)):
        return []
    lines = []
    for key, value in data.items():
        field = section.model_fields.get(str(key))
        if field is None:
            continue
        where = (*loc, key)
        inner = section_type(field.annotation)
        if isinstance(value, str) and _is_number(value) and _takes_number_not(field.annotation, value):
            lines.append(f"{key_path(where)}: a number is needed, not the string {value!r} (remove the quotes)")
        elif isinstance(value, list) and inner is not None:
            lines += [line for n, item in enumerate(value) for line in quoted_numbers(item, inner, (*where, n))]
        elif inner is not None:
            lines += quoted_numbers(value, inner, where)
    return lines


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _takes_number_not(annotation: Any, text: str) -> bool:
    """``annotation`` takes an int or a float, no free string, and ``text`` is none of its words."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = list(members) or [annotation]
    words = [w for k in kinds if typing.get_origin(k) is Literal for w in typing.get_args(k)]
    numeric = any(
        k in (int, float) or (typing.get_origin(k) is typing.Annotated and typing.get_args(k)[0] in (int, float))
        for k in kinds
    )
    return numeric and str not in kinds and text not in words


def _union_key(err: dict, model: type[BaseModel]) -> tuple | None:
    """The config key of an error raised by one member of a union type, else None. Pydantic
    reports such a value once per member, its location ending in the member's tag
    (``workers.max_prefill_tokens.constrained-int``, ``....literal['auto']``)."""
    if err["type"] == "extra_forbidden":
        return None
    loc, section = tuple(err["loc"]), model
    for n, part in enumerate(loc):
        if isinstance(part, int) and get_origin(section) is list:  # an item: the union is the list's item type
            section = get_args(section)[0]
            continue
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


def read_yaml(p: Path) -> Any:
    """The YAML document in file ``p`` ({} when empty). Raises :class:`ConfigError` for a folder,
    a missing file or invalid YAML."""
    if p.is_dir():
        raise ConfigError(str(p), f"is a directory; give the deploy.yaml file itself (such as {p / 'deploy.yaml'})")
    if not p.is_file():
        raise ConfigError(str(p), "no such file (copy deploy.yaml from the repository as a start)")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), f"not valid YAML: {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), f"not UTF-8 text (byte {exc.start}): is it the deploy.yaml file?") from None
    except OSError as exc:
        raise ConfigError(str(p), f"cannot be read: {exc.strerror or exc}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line: where (1-based line and column) and what, without its
    multi-line excerpt of the file."""
    mark = getattr(exc, "problem_mark", None)
    what = "; ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (what or " ".join(str(exc).split()))


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> DeployConfig:
    """Read ``path`` (or defaults when ``None``), apply env and CLI ``overrides``, validate.

    ``overrides`` maps dotted keys (``"router.port"``) to values; ``None`` values are skipped.
    Environment: ``LLAMADEPLOY_API_KEYS`` (comma-separated) and ``LLAMADEPLOY_ADMIN_TOKEN``.
    """
    data: dict[str, Any] = {}
    source = str(path) if path else "defaults"
    if path is not None:
        data = read_yaml(Path(path))
    if not isinstance(data, dict):
        return parse_config(data, source)
    if "models" in data and data["models"] is None:  # a bare `models:` would otherwise serve the default model
        raise ConfigError(source, "models: is empty; list at least one model (- name: ...) or remove it")
    env = {
        "router.api_keys": [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()] or None,
        "router.admin_token": os.environ.get(ADMIN_TOKEN_ENV) or None,
    }
    for dotted, value in {**env, **(overrides or {})}.items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        if _override_entries(data, section, key, value):
            continue
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            break  # let validation report the malformed section
        target[key] = value
    return parse_config(data, source)


def _override_entries(data: dict[str, Any], section: str, key: str, value: Any) -> bool:
    """Apply a flag's ``section.key`` to the entries of a ``models:`` list, where one is given:
    a ``model.*`` flag sets the key in every entry (there is no ``model:`` section to set), a
    ``workers.*`` flag also replaces the key in each entry's own ``workers:`` that gives it (a flag
    overrides the key wherever deploy.yaml says it). True when the flag was fully applied here;
    raises :class:`ConfigError` for ``model.name``, which cannot name several models."""
    entries = data.get("models")
    if not isinstance(entries, list) or section not in ("model", "workers"):
        return False
    if section == "model" and key == "name":
        raise ConfigError(
            "--model",
            "model.name names the one model, but deploy.yaml has a models: list: set each model's name in its entry",
        )
    for entry in entries:
        if not isinstance(entry, dict):
            continue  # validation names it
        own = entry if section == "model" else entry.get("workers")
        if isinstance(own, dict) and (section == "model" or key in own):
            own[key] = value
    return section == "model"
