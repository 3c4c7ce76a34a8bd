"""``apply`` refuses what ``up`` refuses, with ``up``'s message, before anything changes (a
supervisor over fake processes; the embedded model's real shape): the file's own rules, the
tensor-parallel split, the placement, the memory plan with the KV-cache budget; and a scale-up
with no room beside the running replicas is refused by the dry run as by the real run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.config import ConfigError, DeployConfig, parse_config
from launcher.plan.admit import NotAdmitted, admit
from launcher.plan.placement import Inventory
from launcher.rollout.begin import Refused, _plan, _target_config, begin_apply
from launcher.rollout.command import request_config
from router.rollout_protocol import ApplyRequest
from tests.helpers.refusals import ADMIT_REFUSALS, FILE_REFUSALS, case_id
from tests.helpers.supervisor_harness import started

GIB = 2**30
CPUS = Inventory(cpus=[0, 1], ram_available_bytes=16 * GIB)


def running(tmp_path):
    """One CPU replica of the embedded model on both cores (the default deployment on 2 cores)."""
    sup = started(tmp_path, workers=1)
    slot = sup.slots[0]
    slot.spec = replace(slot.spec, cpus=(0, 1))
    return sup


def changed(sup, **sections) -> DeployConfig:
    data = sup.revisions.current.config.model_dump()
    for name, keys in sections.items():
        data[name] = {**data[name], **keys}
    return DeployConfig.model_validate(data)


def up_verdict(cfg: DeployConfig) -> str | None:
    """What ``up`` says of ``cfg`` on the same machine (its one check)."""
    try:
        return admit(cfg, CPUS).memory_problem
    except NotAdmitted as exc:
        return str(exc)


@pytest.mark.parametrize("sections, says, _anywhere", ADMIT_REFUSALS, ids=[case_id(c) for c in ADMIT_REFUSALS])
def test_apply_refuses_what_up_refuses_with_ups_message(tmp_path, sections, says, _anywhere):
    sup = running(tmp_path)
    cfg = changed(sup, **sections)
    message = up_verdict(cfg)
    assert message and says in message, message
    with pytest.raises(Refused) as refused:
        _plan(sup, cfg, CPUS, None, False)
    assert str(refused.value) == message


@pytest.mark.parametrize("data, line", FILE_REFUSALS, ids=[case_id(c) for c in FILE_REFUSALS])
def test_a_file_up_cannot_read_is_refused_with_the_same_lines(data, line):
    with pytest.raises(ConfigError) as up_error:
        parse_config(data, "the new deploy.yaml")
    with pytest.raises(Refused) as refused:
        _target_config(None, ApplyRequest(config=data))
    assert str(refused.value) == str(up_error.value) == f"the new deploy.yaml: {line}"


def test_a_scale_up_without_spare_cores_is_refused_by_the_dry_run_as_by_the_real_run(tmp_path):
    sup = running(tmp_path)
    cfg = changed(sup, workers={"replicas": 2})
    assert up_verdict(cfg) is None  # `up` of this file places two 1-core replicas
    with pytest.raises(Refused, match="no room for worker 1: no spare set of 2 CPU core"):
        _plan(sup, cfg, CPUS, None, False)


def test_a_refused_apply_records_no_revision_and_posts_refused(tmp_path, monkeypatch):
    sup = running(tmp_path)
    posted = []
    monkeypatch.setattr("launcher.rollout.begin.post_status", lambda _sup, status: posted.append(status))
    monkeypatch.setattr("launcher.rollout.begin._discover", lambda: CPUS)
    revisions = len(sup.revisions.history)
    for dry_run in (True, False):
        cfg = changed(sup, workers={"kv_cache_gib": 0.001})
        assert begin_apply(sup, ApplyRequest(id="a", config=request_config(cfg), dry_run=dry_run)) is None
        assert posted[-1].state == "refused" and "kv_cache_gib" in posted[-1].reason and not posted[-1].plan
    assert len(sup.revisions.history) == revisions


def test_an_admitted_change_is_planned(tmp_path, monkeypatch):
    sup = running(tmp_path)
    posted = []
    monkeypatch.setattr("launcher.rollout.begin.post_status", lambda _sup, status: posted.append(status))
    monkeypatch.setattr("launcher.rollout.begin._discover", lambda: CPUS)
    cfg = changed(sup, workers={"max_num_seqs": 3})
    assert begin_apply(sup, ApplyRequest(id="a", config=request_config(cfg), dry_run=True)) is None
    assert posted[-1].state == "planned" and any("replace worker 0 (surge" in line for line in posted[-1].plan)


def test_the_gpus_this_deployment_uses_count_as_free_for_the_check(tmp_path):
    from launcher.plan.placement import GpuInfo
    from launcher.rollout.begin import _as_if_stopped

    sup = running(tmp_path)
    slot = sup.slots[0]
    slot.spec = replace(slot.spec, device="cuda", gpus=(1,))
    busy = [GpuInfo(i, "GPU", f"GPU-{i}", 80 * GIB, 8 * GIB) for i in range(2)]
    seen = _as_if_stopped(sup, Inventory(gpus=busy, cpus=[0, 1], ram_available_bytes=GIB))
    assert [g.free_bytes for g in seen.gpus] == [8 * GIB, 80 * GIB]  # GPU 0 is someone else's


def test_status_names_what_the_last_apply_did():
    from launcher.rollout.command import describe

    done = {
        "id": "a1",
        "state": "done",
        "revision": 4,
        "plan": ["rolling (each replica replaced): workers.max_num_seqs", "wave 0: replace worker 0 (surge: ...)"],
        "progress": ["revision 4 (abc): 1 step(s)", "done in 57.2s"],
    }
    assert describe(done) == (
        "last apply (a1) revision 4: done in 57.2s: rolling (each replica replaced): workers.max_num_seqs; "
        "wave 0: replace worker 0 (surge: ...)"
    )
    live = {"id": "a2", "state": "done", "revision": 5, "plan": ["live (no restart): router.policy"], "progress": []}
    assert describe(live) == "last apply (a2) revision 5: done: live (no restart): router.policy"
    refused = {"id": "a3", "state": "refused", "reason": "the new deploy.yaml: workers.replicas: ...", "plan": []}
    assert describe(refused) == "last apply (a3): refused: the new deploy.yaml: workers.replicas: ..."
