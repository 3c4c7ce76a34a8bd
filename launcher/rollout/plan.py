"""The diff → plan function of ``llamadeploy apply``: pure logic, no I/O.

Given the running configuration, the new one and the replicas as they stand (their group, revision,
readiness and the memory free beside each), :func:`plan_rollout` says which changed keys apply
live (router and supervisor settings: no process restarts), which roll (anything a worker loads or
is started with: each replica is replaced), which cannot change on a running deployment (the
listening addresses, the cluster: ``up`` again), and the ordered steps that carry the change out.

Replicas are grouped by the served model name; a deployment of several models (``models:``) is
planned model by model (:func:`plan_models`: only the models whose settings changed roll, one
after another). The unit of a step is a worker *slot* (a tensor-parallel slot is one unit). A
replacement is ``surge`` (start the new one beside the old, wait ready, then drain and stop the
old) where the memory free beside the replica holds a second copy, else ``drain_first`` (drain
and stop the old, then start the new).
Steps run in waves of at most ``max_unavailable`` replacements (at least one): scale-down first
(the newest slots stop, so fewer are replaced), then scale-up (new slots of the new revision add
capacity), then the replacements, replicas not ready first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from launcher.config import DeployConfig

# Keys the router or the supervisor apply at once: no process restarts.
LIVE_PREFIXES = ("limits.", "supervisor.", "router.batch.")
LIVE_KEYS = frozenset(
    {
        "router.policy",
        "router.api_keys",
        "router.admin_token",
        "router.request_timeout_s",
        "router.max_retries",
        "router.max_migrations",
        "router.hold_s",
        "logging.level",
        "workers.startup_timeout_s",  # the supervisor's
        "workers.heartbeat_timeout_s",  # the router's watchdog
        "workers.stall_timeout_s",
    }
)
# Keys fixed for a deployment's lifetime: its addresses, its cluster, its log format, its placement.
FIXED_PREFIXES = ("cluster.",)
FIXED_KEYS = frozenset(
    {
        "router.host",
        "router.port",
        "router.admin_host",
        "router.admin_port",
        "router.zmq_address",
        "router.keepalive_timeout_s",
        "router.max_connections",
        "router.state_dir",  # the Batch API's database, opened when the router starts
        "limits.max_body_bytes",  # the public app's body limit, set when it is built
        "logging.format",
        # the slots' placement: a replacement keeps its slot's devices (re-placing is `up`'s)
        "workers.devices",
        "workers.gpus_per_replica",
        "workers.tensor_parallel_size",
        "workers.workers_per_gpu",
    }
)
SCALE_KEY = "workers.replicas"
SECRET_KEYS = frozenset({"router.api_keys", "router.admin_token"})

Mode = Literal["surge", "drain_first"]


@dataclass(frozen=True)
class Replica:
    """One worker slot as it stands: its served-model group, the revision it runs, whether it is
    ready, and the bytes free beside it for a second copy on its devices (GPU memory, or RAM on a
    CPU, where the copy may share the replica's cores; 0 when unknown, as on a Ray cluster)."""

    worker_id: int
    group: str
    revision: int
    ready: bool = True
    free_bytes: int = 0


@dataclass(frozen=True)
class Step:
    """One unit of the rollout. ``replace``: slot ``worker_id`` is replaced (``mode``) by a
    replica of the new revision; ``start``: a new slot ``worker_id`` starts (scale up); ``stop``:
    slot ``worker_id`` drains and stops (scale down). Steps with the same ``wave`` run together."""

    kind: Literal["replace", "start", "stop"]
    worker_id: int
    group: str
    wave: int
    mode: Mode | None = None

    def describe(self) -> str:
        """One line for the printed plan."""
        if self.kind == "replace":
            how = "start the new one, then drain the old" if self.mode == "surge" else "drain, then start the new one"
            return f"wave {self.wave}: replace worker {self.worker_id} ({self.mode}: {how})"
        if self.kind == "start":
            return f"wave {self.wave}: start worker {self.worker_id} (scale up)"
        return f"wave {self.wave}: drain and stop worker {self.worker_id} (scale down)"


@dataclass(frozen=True)
class RolloutPlan:
    """What ``apply`` does: the changed keys by kind and the ordered steps."""

    live: tuple[str, ...]
    rolling: tuple[str, ...]
    fixed: tuple[str, ...]
    steps: tuple[Step, ...]
    max_unavailable: int
    warnings: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing changed."""
        return not (self.live or self.rolling or self.steps)

    def problems(self) -> list[str]:
        """One line per key that cannot change on a running deployment (``apply`` refuses them)."""
        return [
            f"{key}: cannot change on a running deployment; stop it and `llamadeploy up` again" for key in self.fixed
        ]

    def lines(self) -> list[str]:
        """The plan as printed by ``apply`` (and ``--dry-run``)."""
        if self.empty:
            return ["nothing to change"]
        out = [f"live (no restart): {', '.join(self.live)}"] if self.live else []
        if self.rolling:
            out.append(f"rolling (each replica replaced): {', '.join(self.rolling)}")
        out += [step.describe() for step in self.steps]
        return out + [f"warning: {w}" for w in self.warnings]


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: ``{"router": {"port": 1}}`` → ``{"router.port": 1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(old: DeployConfig, new: DeployConfig) -> list[str]:
    """Every dotted key whose value differs, sorted."""
    a, b = flatten(old.model_dump()), flatten(new.model_dump())
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def classify(keys: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Split changed keys into ``(live, rolling, fixed)``; ``workers.replicas`` is none of them
    (it is the scale, compared as counts)."""
    live, rolling, fixed = [], [], []
    for key in keys:
        if key == SCALE_KEY:
            continue
        if key in FIXED_KEYS or key.startswith(FIXED_PREFIXES):
            fixed.append(key)
        elif key in LIVE_KEYS or key.startswith(LIVE_PREFIXES):
            live.append(key)
        else:
            rolling.append(key)
    return tuple(live), tuple(rolling), tuple(fixed)


def default_max_unavailable(replicas: int) -> int:
    """1 when there is more than one replica; 0 for one (its replacement must surge)."""
    return 1 if replicas > 1 else 0


def plan_rollout(
    old: DeployConfig,
    new: DeployConfig,
    replicas: Sequence[Replica],
    new_replicas: int,
    need_bytes: int,
    max_unavailable: int | None = None,
    revision: int | None = None,
    taken: Iterable[int] = (),
) -> RolloutPlan:
    """The plan from ``old`` to ``new`` for ``replicas`` (the running slots).

    ``new_replicas`` is the new config's replica count (resolved: ``auto`` placed), ``need_bytes``
    the memory one new replica takes (weights + KV cache + overhead). ``max_unavailable``
    (default :func:`default_max_unavailable` of the current count) bounds how many replicas may
    be out of service at once; a replica not ready now counts as out already. ``revision``: the
    target's number; replicas already on it are not replaced (a rollback replaces only what the
    failed rollout changed). ``taken``: slot ids that other models' slots hold (a new slot takes
    none of them). Raises ValueError
    for a negative ``max_unavailable`` or ``new_replicas < 1``.
    """
    if new_replicas < 1:
        raise ValueError("a deployment needs at least one replica")
    budget = default_max_unavailable(len(replicas)) if max_unavailable is None else max_unavailable
    if budget < 0:
        raise ValueError("--max-unavailable must be >= 0")
    live, rolling, fixed = classify(changed_keys(old, new))
    group = new.model.public_name  # a renamed model rolls (model.served_name or model.name changed)
    keep, stop = _scale_down(replicas, new_replicas)
    steps = [Step("stop", r.worker_id, r.group, wave=0) for r in stop]
    wave = 1 if steps else 0
    ids = free_ids({r.worker_id for r in keep} | set(taken), new_replicas - len(keep))
    starts = [Step("start", wid, group, wave) for wid in ids]
    stale = [r for r in keep if rolling and r.revision != revision]
    swaps, warnings = _replacements(stale, group, need_bytes, budget, wave + bool(starts))
    return RolloutPlan(live, rolling, fixed, tuple(steps + starts + swaps), budget, tuple(warnings))


def free_ids(used: Iterable[int], count: int) -> list[int]:
    """The ``count`` lowest slot ids not in ``used``: a new slot takes the id of one that left, so
    ids stay few (each has its CURVE key pair, made at ``up``)."""
    taken, out, wid = set(used), [], 0
    while len(out) < count:
        if wid not in taken:
            out.append(wid)
        wid += 1
    return out


def _scale_down(replicas: Sequence[Replica], count: int) -> tuple[list[Replica], list[Replica]]:
    """``(keep, stop)``: the ``count`` oldest slots are kept; the newest (highest ids) stop."""
    ordered = sorted(replicas, key=lambda r: r.worker_id)
    return ordered[:count], ordered[count:][::-1]


def _replacements(
    replicas: Sequence[Replica], group: str, need_bytes: int, budget: int, wave: int
) -> tuple[list[Step], list[str]]:
    """The replace steps in waves of at most ``max(1, budget)``: replicas not ready first (they
    serve nothing now, so replacing them costs nothing), then by id. Each is ``surge`` where the
    bytes free beside it hold a new replica, else ``drain_first``; a drain-first replacement with a
    budget of 0 is unavoidable and warned about."""
    steps: list[Step] = []
    warnings: list[str] = []
    per_wave = max(1, budget)
    for n, r in enumerate(sorted(replicas, key=lambda r: (r.ready, r.worker_id))):
        mode: Mode = "surge" if r.free_bytes >= need_bytes else "drain_first"
        if mode == "drain_first" and r.ready and budget == 0 and not warnings:
            warnings.append(
                "no room for a second copy beside a replica and --max-unavailable is 0: it drains first, "
                "so it serves nothing while its replacement loads"
            )
        steps.append(Step("replace", r.worker_id, group, wave + n // per_wave, mode))
    return steps, warnings


def models_changed(old: DeployConfig, new: DeployConfig) -> str | None:
    """Why ``apply`` cannot take ``new`` over ``old`` model by model: a model added, removed,
    renamed or moved in the ``models:`` list (a new model needs its own placement: ``up``'s);
    None when both serve the same names in the same order."""
    before, after = [one.name for one in old.served()], [one.name for one in new.served()]
    if before == after or (len(before) == 1 and len(after) == 1):  # one model: a rename rolls
        return None
    return (
        f"models: apply changes the models a deployment serves, not which ({', '.join(before)} -> "
        f"{', '.join(after)}): adding, removing, renaming or reordering a model needs `llamadeploy up` again"
    )


def plan_models(
    old: DeployConfig,
    new: DeployConfig,
    replicas: Sequence[Replica],
    counts: Mapping[str, int],
    needs: Mapping[str, int],
    max_unavailable: int | None = None,
    revision: int | None = None,
) -> RolloutPlan:
    """The plan from ``old`` to ``new`` for a deployment of one model or several (``models:``).

    Each model is planned alone (:func:`plan_rollout` over its own replicas, the ``group`` named as
    it is served, from each file's view of that model: :meth:`DeployConfig.for_model`), with its
    replica count ``counts[name]`` and the bytes one replica needs ``needs[name]``; a model whose
    settings did not change gets no step. The models roll one after another, in deploy.yaml's
    order (the waves of the second follow the first's), so at most one model has a replica out of
    service at a time, and ``max_unavailable`` (default: per model, by its replica count) bounds
    each. The changed keys of a model's own entry are shown with its name. Raises ValueError as
    :func:`plan_rollout` does, or when the served models differ (:func:`models_changed`)."""
    if problem := models_changed(old, new):
        raise ValueError(problem)
    served = new.served()
    if len(served) == 1:  # one group (a rename in progress may show two names): every replica is its
        need = max(needs.values())
        return plan_rollout(old, new, replicas, sum(counts.values()), need, max_unavailable, revision)
    live: dict[str, None] = {}
    fixed: dict[str, None] = {}
    rolling: list[str] = []
    steps: list[Step] = []
    warnings: dict[str, None] = {}
    for k, one in enumerate(served):
        mine = [r for r in replicas if r.group == one.name]
        taken = {r.worker_id for r in replicas if r.group != one.name} | {s.worker_id for s in steps}
        part = plan_rollout(
            old.for_model(k),
            new.for_model(k),
            mine,
            counts[one.name],
            needs[one.name],
            max_unavailable,
            revision,
            taken,
        )
        live.update(dict.fromkeys(part.live))
        fixed.update(dict.fromkeys(part.fixed))
        rolling += [f"{key} ({one.name})" for key in part.rolling]
        first = max((s.wave for s in steps), default=-1) + 1
        steps += [replace(s, wave=s.wave + first) for s in part.steps]
        warnings.update(dict.fromkeys(part.warnings))
    budget = default_max_unavailable(len(replicas)) if max_unavailable is None else max_unavailable
    return RolloutPlan(tuple(live), tuple(rolling), tuple(fixed), tuple(steps), budget, tuple(warnings))
