"""Each child process's command line is one definition read back on the other side: what the
launcher writes (``to_argv``) is what the child reads (``from_argv``), and a bad one is refused."""

from __future__ import annotations

import pytest

from router.args import RouterArgs
from worker.contract.args import WorkerArgs


@pytest.mark.parametrize(
    "args",
    [
        WorkerArgs("/run/worker.json", 3, "cpu", "/model", "ipc:///run/w.ipc", cpus=(4, 5)),
        WorkerArgs("w.json", 1, "cuda", "/m", "tcp://10.0.0.1:8002", rank=1, world_size=2, dist_init="tcp://h:9"),
    ],
)
def test_a_worker_reads_back_what_the_launcher_wrote(args):
    assert WorkerArgs.from_argv(args.to_argv()) == args


@pytest.mark.parametrize(
    "flags",
    [
        ["--rank", "2", "--world-size", "2", "--dist-init", "tcp://h:9"],  # rank outside 0..1
        ["--world-size", "2"],  # several ranks, no rendezvous
        ["--device", "tpu"],
    ],
)
def test_a_worker_refuses_arguments_that_cannot_run_together(flags, capsys):
    base = ["--config", "w.json", "--worker-id", "0", "--device", "cpu", "--model-path", "/m", "--address", "ipc://a"]
    with pytest.raises(SystemExit) as exc:
        WorkerArgs.from_argv(base + flags)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_worker_role_names_its_rank_only_in_a_tensor_parallel_slot():
    one = WorkerArgs("w.json", 3, "cpu", "/m", "ipc://a")
    assert one.role == "worker-3"
    assert WorkerArgs("w.json", 3, "cuda", "/m", "ipc://a", rank=1, world_size=2, dist_init="tcp://h:9").role == (
        "worker-3 rank 1"
    )


@pytest.mark.parametrize("standby", [False, True])
def test_a_router_reads_back_what_the_supervisor_wrote(standby):
    args = RouterArgs(
        "/run/router.json",
        ("/a", "/b"),
        "ipc:///run/w.ipc",
        events="ipc:///run/events",
        started=1700000000,
        event_log="/run/events.jsonl",
        restarts=0 if standby else 2,
        standby=standby,
    )
    assert RouterArgs.from_argv(args.to_argv()) == args
