"""The supervisor's answer to an ``apply``: validate, plan, then refuse, report or start the rollout.

:func:`begin_apply` runs when the router passes on an
:class:`~router.admin_protocol.ApplyRequested` event. The new configuration is checked with
``up``'s one check (:func:`launcher.plan.admit.admit`: the file's own rules, the tensor-parallel
split, the placement, the memory plan with the KV-cache budget, the model found and fit for its
task) and the room a scale-up needs beside the running replicas, before ``--dry-run`` answers:
a dry run gives the verdict the real run reaches. Keys that cannot change on a running
deployment refuse the whole apply, one line each; ``--dry-run`` reports the plan only. A change of
router and supervisor settings alone is applied at once (a new revision, no process restarted);
anything else starts a :class:`~launcher.rollout.executor.Rollout`. A deployment of several models
(``models:``) rolls the models whose settings changed, one after another, and leaves the others'
workers running (:func:`~launcher.rollout.plan.plan_models`); a file that adds, removes, renames or
reorders a model is refused (a new model needs its own placement: ``up``'s).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import msgspec

from launcher.config import ConfigError, DeployConfig, ModelEntry, parse_config
from launcher.plan.admit import NotAdmitted, admit
from launcher.plan.placement import Inventory
from launcher.rollout.executor import Rollout, Target, move_slots, post_status, shape_of
from launcher.rollout.plan import RolloutPlan, models_changed, plan_models
from launcher.rollout.room import new_spec, replica_need
from launcher.supervise.control import SlotControl
from router.rollout_protocol import ApplyRequest, LiveSettings, RolloutStatus

log = logging.getLogger(__name__)


class Refused(Exception):
    """The apply is refused before anything changes; ``str()``: one line per problem."""


def begin_apply(sup: SlotControl, req: ApplyRequest) -> Rollout | None:
    """Answer ``req`` for supervisor ``sup``: the rollout to step, or None when it was refused,
    was a dry run, changed nothing or only live settings (each reported to the router)."""

    def reply(state: str, **fields) -> None:
        """Post this apply's outcome to the router."""
        post_status(sup, RolloutStatus(id=req.id, state=state, **fields))

    if sup.rollout is not None:
        reply("refused", reason="another apply is in progress")
        return None
    old = current_target(sup)
    try:
        cfg = _target_config(sup, req)
        inventory = Inventory() if sup.on_cluster else _discover()
        plan = _plan(sup, cfg, inventory, req.max_unavailable, req.rollback)
        models = _models_of(cfg, old)
    except Refused as exc:
        reply("refused", reason=str(exc))
        return None
    if req.dry_run or plan.empty:
        reply("planned" if req.dry_run else "done", plan=plan.lines())
        return None
    new = _new_target(sup, cfg, models, req.rollback)
    if not plan.steps:
        _apply_live(sup, new)
        reply("done", plan=plan.lines(), revision=new.revision.number, hash=new.revision.hash)
        return None
    rollout = Rollout(sup, req.id, old, new, plan, inventory, plan.max_unavailable, is_rollback=req.rollback)
    renamed = old.config.model.public_name != cfg.model.public_name
    rollout.adopt(_during(old.config, cfg), also=[cfg.model] if renamed and not cfg.models else [])
    rollout.note(f"revision {new.revision.number} ({new.revision.hash}): {len(plan.steps)} step(s)")
    return rollout


def _discover() -> Inventory:
    from launcher.plan.placement import discover

    return discover()


def _target_config(sup: SlotControl, req: ApplyRequest) -> DeployConfig:
    """The configuration to go to: the request's (validated again), or the previous revision's."""
    if req.rollback:
        prev = sup.revisions.previous()
        if prev is None:
            raise Refused("no earlier revision is kept to roll back to")
        return prev.config
    try:
        cfg = parse_config(req.config, "the new deploy.yaml")
    except ConfigError as exc:
        raise Refused(str(exc)) from None
    if problem := models_changed(sup.revisions.current.config, cfg):
        raise Refused(problem)
    from launcher.plan.resolve import resolve_for_apply

    return resolve_for_apply(cfg, sup.revisions.current.config)


def _during(old: DeployConfig, new: DeployConfig) -> DeployConfig:
    """The router's settings while the rollout runs: ``new``'s, with each model's section as it
    runs now (the old model's limits until its replicas are replaced)."""
    if not new.models:
        return new.model_copy(update={"model": old.model})
    before = old.served()
    entries = [
        ModelEntry.model_validate({**before[k].model.model_dump(), "workers": entry.workers})
        for k, entry in enumerate(new.models)
    ]
    return new.model_copy(update={"models": entries, "model": before[0].model})


def _admitted_counts(sup: SlotControl, cfg: DeployConfig, inventory: Inventory) -> dict[str, int]:
    """The replicas ``cfg`` asks for, per served model, once ``up``'s own check
    (:func:`launcher.plan.admit.admit`: tensor parallel, placement, memory plan with the KV-cache
    budget) passes on this machine as if this deployment's workers were stopped (their RAM counted
    free). Raises :class:`Refused` with ``up``'s message. On a Ray cluster (no local inventory,
    one model) the count alone."""
    names = [one.name for one in cfg.served()]
    if sup.on_cluster:
        from launcher.plan.layouts import tp_refusal

        if problem := tp_refusal(cfg):
            raise Refused(problem)
        return {names[0]: len(sup.slots) if cfg.workers.replicas == "auto" else cfg.workers.replicas}
    try:
        admission = admit(cfg, _as_if_stopped(sup, inventory))
    except NotAdmitted as exc:
        raise Refused(str(exc)) from None
    if admission.memory_problem:
        raise Refused(admission.memory_problem)
    return {name: sum(spec.model == k for spec in admission.specs) for k, name in enumerate(names)}


def _as_if_stopped(sup: SlotControl, inventory: Inventory) -> Inventory:
    """``inventory`` as ``up`` of the new file would see it with this deployment stopped: the RAM
    its CPU workers hold counted as available, the GPUs its slots use as free."""
    table = sup.read_table() or {}
    held = sum(info.mem_bytes for info in table.values() if info.device.startswith("cpu"))
    ours = {g for slot in sup.slots.values() for g in slot.spec.gpus}
    gpus = [replace(g, free_bytes=g.total_bytes) if g.index in ours else g for g in inventory.gpus]
    return replace(inventory, gpus=gpus, ram_available_bytes=inventory.ram_available_bytes + held)


def _room_for_starts(sup: SlotControl, plan: RolloutPlan, inventory: Inventory) -> None:
    """Each new slot of a scale-up finds its place as the rollout will place it
    (:func:`launcher.rollout.room.new_spec`: a spare core set beside the running replicas, which
    keep theirs). Raises :class:`Refused` naming the slot that would not."""
    if sup.on_cluster:
        return
    stopping = {step.worker_id for step in plan.steps if step.kind == "stop"}
    specs = [s.spec for wid, s in sup.slots.items() if wid not in stopping]
    names = [one.name for one in sup.revisions.current.config.served()]
    every = [s.spec for s in sup.slots.values()]
    for step in plan.steps:
        if step.kind != "start":
            continue
        shape = shape_of(specs or every, names.index(step.group) if step.group in names else 0)
        spec = new_spec(shape, step.worker_id, specs, inventory)
        if spec is None:
            raise Refused(
                f"workers.replicas: no room for worker {step.worker_id}: no spare set of {len(shape.cpus)} CPU "
                "core(s) beside the running replicas, which keep theirs; stop the deployment and "
                "`llamadeploy up` the new file to place every replica afresh"
            )
        specs.append(spec)


def _plan(
    sup: SlotControl, cfg: DeployConfig, inventory: Inventory, max_unavailable: int | None, rollback: bool
) -> RolloutPlan:
    """The plan to ``cfg`` over the slots as they stand (``rollback``: to the previous revision),
    after ``up``'s check. Raises :class:`Refused`."""
    from launcher.rollout.executor import replicas_of

    counts = _admitted_counts(sup, cfg, inventory)
    specs = [s.spec for s in sup.slots.values()]
    needs = {
        one.name: replica_need(cfg.for_model(k), inventory, shape_of(specs, k)) for k, one in enumerate(cfg.served())
    }
    try:
        plan = plan_models(
            sup.revisions.current.config,
            cfg,
            replicas_of(sup, inventory),
            counts,
            needs,
            max_unavailable,
            revision=sup.revisions.previous().number if rollback else sup.revisions.current.number + 1,
        )
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if plan.fixed:
        raise Refused("\n".join(plan.problems()))
    _room_for_starts(sup, plan, inventory)
    return plan


def current_target(sup: SlotControl) -> Target:
    """What the slots on the current revision are started with, per served model."""
    rev = sup.revisions.current
    settings, models = [], []
    for k in range(len(rev.config.served())):
        slot = next(
            (s for s in sup.slots.values() if s.revision == rev.number and s.settings_path and s.spec.model == k),
            None,
        )
        settings.append(slot.settings_path if slot else sup.worker_settings_paths[k])
        models.append(slot.model_path if slot else sup.model_paths[k])
    return Target(rev, tuple(settings), tuple(models))


def _models_of(cfg: DeployConfig, old: Target) -> list[Path]:
    """Each of ``cfg``'s models, resolved as ``up`` resolves it (a model the old revision runs
    under the same name and quantization: its folder). Raises :class:`Refused` when one cannot be
    found or served for its task (``up``'s refusals: task generate on an encoder, int8 embeddings)."""
    from launcher.models import ModelNotFound, resolve_model
    from worker.contract.tasks import TaskError, check_task

    before = old.config.served()
    paths = []
    for k, one in enumerate(cfg.served()):
        was = before[k].model if k < len(before) else None
        same = was is not None and (one.model.name, one.model.quantization) == (was.name, was.quantization)
        try:
            model = old.model_paths[k] if same else resolve_model(one.model.name, quantization=one.model.quantization)
            check_task(one.model, model)
        except (ModelNotFound, OSError, TaskError) as exc:
            log.error("apply: %s", exc)
            raise Refused(str(exc).splitlines()[0]) from None
        paths.append(Path(model))
    return paths


def _new_target(sup: SlotControl, cfg: DeployConfig, models: list[Path], rollback: bool) -> Target:
    """The new revision (recorded; for a rollback the previous one made current again), its worker
    settings file per model and its models (:func:`_models_of`)."""
    if rollback:
        rev = sup.revisions.previous()
        sup.revisions.restore(rev)
    else:
        rev = sup.revisions.record(cfg)
    settings = []
    for k in range(len(models)):
        path = sup.run_dir / (f"worker-r{rev.number}.json" if k == 0 else f"worker-r{rev.number}-{k}.json")
        path.write_text(cfg.worker_settings(k).model_dump_json())
        settings.append(path)
    return Target(rev, tuple(settings), tuple(models))


def _apply_live(sup: SlotControl, new: Target) -> None:
    """Only router and supervisor settings changed: apply them, and the slots (whose worker
    settings are unchanged) are on the new revision without restarting."""
    live = LiveSettings(settings=new.config.router_settings().model_dump(mode="json"))
    sup.admin.try_call("POST", "/admin/settings", msgspec.to_builtins(live))
    sup.adopt(new.config)
    move_slots(sup, new)
