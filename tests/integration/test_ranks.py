"""A tensor-parallel slot (launcher/supervise/ranks.py): real rank processes behind Popen's interface, and
the supervisor's crash rules acting on the slot as a whole (fake process table, real router table)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace

import pytest

from launcher.plan.placement import GpuInfo, WorkerSpec
from launcher.supervise.launch import WorkerLaunch
from launcher.supervise.ranks import RankGroup
from launcher.supervise.supervisor import Slot, spawn
from router.admin_protocol import WorkerState
from tests.helpers.deployment import alive, wait_for
from tests.helpers.supervisor_harness import Harness
from worker.contract.units import GiB

# A stand-in rank: writes what it was started with, then waits to be stopped.
RANK = (
    "import json, os, sys, time\n"
    "rank = sys.argv[sys.argv.index('--rank') + 1]\n"
    "json.dump({'argv': sys.argv[1:], 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES')},"
    " open(os.path.join(os.environ['OUT'], rank + '.json'), 'w'))\n"
    "time.sleep(120)\n"
)


def gpu_spec(tp: int = 2) -> WorkerSpec:
    info = tuple(GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in (2, 3))
    return WorkerSpec(0, "cuda", gpus=(2, 3), gpu_info=info, tp=tp)


def stand_in(spec: WorkerSpec, program: str, env: dict[str, str] | None = None) -> WorkerLaunch:
    """Slot ``spec``'s launch with ``python -c program`` in place of the worker."""
    launch = WorkerLaunch.for_slot(spec, "RUN/worker.json", "/model", "ipc://unused", env or {})
    return replace(launch, program=("-c", program))


def start_group(tmp_path, spec: WorkerSpec) -> RankGroup:
    return RankGroup.start(spec, stand_in(spec, RANK, {"OUT": str(tmp_path)}), spawn)


def started_ranks(tmp_path, n: int) -> list[dict]:
    paths = [tmp_path / f"{r}.json" for r in range(n)]
    wait_for(lambda: all(p.is_file() and p.stat().st_size for p in paths), 30, what="every rank started")
    return [json.loads(p.read_text()) for p in paths]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_rank_gets_its_rank_its_own_gpu_and_one_fresh_rendezvous_per_start(tmp_path):
    group = start_group(tmp_path, gpu_spec())
    try:
        ranks = started_ranks(tmp_path, 2)
        assert [flag(r["argv"], "--rank") for r in ranks] == ["0", "1"]
        assert {flag(r["argv"], "--world-size") for r in ranks} == {"2"}
        assert [r["cuda"] for r in ranks] == ["2", "3"]  # set before the child imports anything
        dist = {flag(r["argv"], "--dist-init") for r in ranks}
        assert len(dist) == 1 and dist.pop().startswith("tcp://127.0.0.1:")
        assert group.pid == group.procs[0].pid and group.poll() is None and group.returncode is None
    finally:
        group.kill()
        group.wait(10)
    again = RankGroup.start(gpu_spec(), stand_in(gpu_spec(), "pass"), spawn)
    again.wait(30)
    assert again.dist_init != group.dist_init


def test_kill_9_of_a_follower_takes_the_whole_slot_down(tmp_path):
    group = start_group(tmp_path, WorkerSpec(0, "cpu", cpus=(0, 1), tp=2))
    started_ranks(tmp_path, 2)
    leader, follower = group.procs
    os.kill(follower.pid, signal.SIGKILL)
    code = wait_for(group.poll, 30, what="the slot noticed its rank 1 died")
    assert code == -signal.SIGKILL and group.exited_rank == 1 and group.returncode == code
    assert not alive(leader.pid) and leader.returncode == -signal.SIGKILL  # killed and reaped with it


def test_a_signal_reaches_every_rank_and_wait_returns_rank_0s_code(tmp_path):
    group = start_group(tmp_path, WorkerSpec(0, "cpu", cpus=(0, 1, 2, 3), tp=2))
    started_ranks(tmp_path, 2)
    group.send_signal(signal.SIGTERM)
    assert group.wait(30) == -signal.SIGTERM
    assert all(p.returncode == -signal.SIGTERM for p in group.procs)
    with pytest.raises(subprocess.TimeoutExpired):
        blocked = RankGroup.start(
            WorkerSpec(0, "cpu", tp=2), stand_in(WorkerSpec(0, "cpu", tp=2), "import time; time.sleep(30)"), spawn
        )
        try:
            blocked.wait(0.2)
        finally:
            blocked.kill()
            blocked.wait(10)


def test_ranks_split_the_cores_when_there_are_enough_else_share_them():
    four = WorkerSpec(0, "cpu", cpus=(4, 5, 6, 7, 8), tp=2)
    assert [four.rank_cpus(r) for r in range(2)] == [(4, 5), (6, 7, 8)]
    one = WorkerSpec(0, "cpu", cpus=(3,), tp=2)
    assert [one.rank_cpus(r) for r in range(2)] == [(3,), (3,)]
    slot = WorkerLaunch.for_slot(four, "RUN/worker.json", "/model", "ipc://x", {})
    assert flag(slot.argv(), "--cpus") == "4,5,6,7,8" and "--rank" not in slot.argv()
    argv = slot.for_rank(four, 1, "tcp://127.0.0.1:9").argv()
    assert argv[:2] == ["-m", "worker.main"] and flag(argv, "--cpus") == "6,7,8"
    assert argv[-6:] == ["--rank", "1", "--world-size", "2", "--dist-init", "tcp://127.0.0.1:9"]


def test_rank_env_shows_one_gpu_and_the_label_names_the_slot():
    spec = gpu_spec()
    env = spec.rank_env(1)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert [g["index"] for g in json.loads(env["LLAMADEPLOY_EXPECTED_GPUS"])["gpus"]] == [3]
    assert spec.label == "cuda[2,3] (TP 2)" and spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["LLAMADEPLOY_SLOT_DEVICE"] == "cuda[2,3] (TP 2)"  # what rank 0 says in its Hello
    assert WorkerSpec(0, "cpu", cpus=(0, 1), tp=2).label == "cpu[0,1] (TP 2)"
    assert WorkerSpec(0, "cpu", cpus=(0, 1)).label == "cpu[0,1]"


# ---- the supervisor acting on a slot of ranks ------------------------------------------------


def tp_supervisor(tmp_path) -> Harness:
    sup = Harness(tmp_path)
    sup.slots = {i: Slot(WorkerSpec(i, "cpu", cpus=(2 * i, 2 * i + 1), tp=2)) for i in range(2)}
    sup.start()
    assert sup.row(0).device == "cpu[0,1] (TP 2)"  # as reported at the start, before the worker's Hello
    for wid in sup.slots:
        sup.ready(wid)
    return sup


def test_supervisor_restarts_the_slot_as_a_whole_when_one_rank_dies(tmp_path):
    sup = tp_supervisor(tmp_path)
    first = sup.proc_of(0)
    assert isinstance(first, RankGroup) and len(sup.procs) == 1 + 4  # the router, then 2 × 2 ranks
    assert sup.row(0).pid == first.procs[0].pid
    leader, follower = first.procs
    follower.exit(-signal.SIGKILL)
    sup.tick()
    assert leader.signals == [signal.SIGKILL]  # the survivor would hang in its next collective
    assert (sup.row(0).state, sup.row(0).exit_reason) == (WorkerState.DEAD, "rank 1 killed by SIGKILL")
    assert sup.row(1).state == WorkerState.READY  # the other replica is untouched
    sup.tick(1.1)
    second = sup.proc_of(0)
    assert isinstance(second, RankGroup) and second is not first and second.dist_init != first.dist_init
    assert (sup.row(0).state, sup.row(0).pid, sup.row(0).restarts) == (WorkerState.STARTING, second.pid, 1)
    assert [flag(p.args, "--rank") for p in second.procs] == ["0", "1"]


def test_a_hung_slot_is_killed_whole_and_a_requested_exit_restarts_it_at_once(tmp_path):
    sup = tp_supervisor(tmp_path)
    hung = sup.proc_of(1)
    sup.admin.pool.mark_lost(1, "no heartbeat for 10s")
    sup.tick()
    assert [p.signals for p in hung.procs] == [[signal.SIGKILL], [signal.SIGKILL]]
    asked = sup.proc_of(0)
    asked.procs[1].exit(0)  # restart-worker: rank 0 was told to stop, and stopped its follower first
    sup.tick()
    assert sup.proc_of(0) is asked and asked.procs[0].signals == []  # rank 0 may finish (its Bye)
    asked.procs[0].exit(0)
    sup.tick()
    assert sup.proc_of(0) is not asked and sup.row(0).restarts == 1  # at once: no crash backoff
    assert sup.row(0).exit_reason == "rank 0 exit code 0"
