"""The supervisor's rollout over fake processes and a real router worker table (no process is
spawned): surge replacements on spare cores, and a crashing replacement rolled back."""

from __future__ import annotations

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory
from launcher.rollout.executor import Rollout, Target
from launcher.rollout.plan import Replica, plan_rollout
from tests.helpers.supervisor_harness import started

GIB = 2**30


def rollout_to(sup, changes: dict, free: int, cpus: int = 4) -> Rollout:
    old_rev = sup.revisions.current
    data = old_rev.config.model_dump()
    for section, keys in changes.items():
        data[section] = {**data[section], **keys}
    new_cfg = DeployConfig.model_validate(data)
    replicas = [Replica(wid, "m", 1, slot.ready(), free) for wid, slot in sup.slots.items()]
    plan = plan_rollout(old_rev.config, new_cfg, replicas, len(sup.slots), GIB, revision=2)
    new_rev = sup.revisions.record(new_cfg)
    settings = sup.run_dir / "worker-r2.json"
    settings.write_text(new_cfg.worker_settings().model_dump_json())
    old = Target(old_rev, (sup.worker_settings_path,), (sup.model_paths[0],))
    inventory = Inventory(cpus=list(range(cpus)), ram_available_bytes=8 * GIB)
    sup.rollout = Rollout(sup, "r1", old, Target(new_rev, (settings,), (sup.model_paths[0],)), plan, inventory, 1)
    return sup.rollout


def settle(sup, ticks: int = 3) -> None:
    for _ in range(ticks):
        sup.tick(0.2)


def test_surge_starts_the_new_replica_on_spare_cores_before_the_old_one_stops(tmp_path):
    sup = started(tmp_path)
    ro = rollout_to(sup, {"workers": {"max_num_seqs": 3}}, free=2 * GIB)
    sup.tick()
    assert set(sup.slots) == {0, 1, 2} and sup.slots[2].spec.cpus == (2,)
    assert sup.slots[0].alive()  # the old one serves until the new one is ready
    sup.ready(2)
    settle(sup)
    old_pid = sup.proc_of(0).pid
    sup.proc_of(0).exit(0)  # the drained worker exits as the router told it: its slot is retired
    settle(sup)
    # the next surge (worker 1's) takes the id and the cores worker 0 left
    assert sup.proc_of(0).pid != old_pid and sup.slots[0].revision == 2 and sup.slots[0].spec.cpus == (0,)
    assert sup.slots[1].alive() and sup.slots[1].revision == 1
    sup.ready(0)
    settle(sup)
    sup.proc_of(1).exit(0)
    settle(sup)
    assert sup.rollout is None and ro.state == "done"
    assert set(sup.slots) == {0, 2} and 1 not in sup.admin.pool.workers
    assert {sup.row(w).revision for w in sup.slots} == {2}


def test_a_crashing_replacement_is_rolled_back_to_the_old_revision(tmp_path):
    sup = started(tmp_path)
    ro = rollout_to(sup, {"model": {"dtype": "bfloat16"}}, free=0)
    settle(sup)
    sup.proc_of(0).exit(0)  # drained and told to exit: started again on revision 2
    settle(sup)
    assert sup.slots[0].revision == 2 and sup.slots[0].alive()
    sup.proc_of(0).exit(1)  # the new revision crashes at start
    settle(sup)
    assert ro.state == "rolling_back" and "worker 0 on revision 2: exit code 1" in ro.reason
    assert sup.slots[0].revision == 1 and sup.slots[0].alive()  # started again on the old settings
    sup.ready(0)
    settle(sup)
    assert sup.rollout is None and ro.state == "failed"
    assert sup.revisions.current.number == 1 and sup.revisions.previous() is None
    assert sup.slots[1].revision == 1 and sup.slots[1].ready()  # never touched
