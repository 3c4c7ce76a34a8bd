"""One worker start, built once: the local, tensor-parallel and Ray paths derive theirs from it."""

from __future__ import annotations

import json

from launcher.plan.placement import GpuInfo, WorkerSpec
from launcher.supervise.launch import WorkerLaunch
from worker.contract.env import EXPECTED_GPUS_ENV, SLOT_DEVICE_ENV
from worker.contract.units import GiB


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_slot_is_started_with_its_settings_file_its_device_and_its_placement_env():
    spec = WorkerSpec(3, "cpu", cpus=(4, 5))
    launch = WorkerLaunch.for_slot(spec, "/run/worker.json", "/model", "ipc:///run/w.ipc", {"KEYS": "/run/curve"})
    argv = launch.argv()
    assert argv[:2] == ["-m", "worker.main"] and flag(argv, "--config") == "/run/worker.json"
    assert (flag(argv, "--worker-id"), flag(argv, "--device"), flag(argv, "--cpus")) == ("3", "cpu", "4,5")
    assert (flag(argv, "--model-path"), flag(argv, "--address")) == ("/model", "ipc:///run/w.ipc")
    assert "--rank" not in argv
    assert launch.env == {**spec.env, "KEYS": "/run/curve"} and launch.env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_rank_gets_its_own_gpu_and_the_rendezvous():
    info = tuple(GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in (2, 3))
    spec = WorkerSpec(0, "cuda", gpus=(2, 3), gpu_info=info, tp=2)
    slot = WorkerLaunch.for_slot(spec, "w.json", "/m", "ipc://a", {"KEYS": "k"})
    one = slot.for_rank(spec, 1, "tcp://127.0.0.1:9")
    assert one.argv()[-6:] == ["--rank", "1", "--world-size", "2", "--dist-init", "tcp://127.0.0.1:9"]
    assert one.env["CUDA_VISIBLE_DEVICES"] == "3" and one.env["KEYS"] == "k"
    assert [g["index"] for g in json.loads(one.env[EXPECTED_GPUS_ENV])["gpus"]] == [3]
    assert one.env[SLOT_DEVICE_ENV] == "cuda[2,3] (TP 2)"
    assert slot.env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the slot's own launch is unchanged


def test_on_a_node_only_the_settings_path_env_and_device_change():
    slot = WorkerLaunch.for_slot(WorkerSpec(1, "cuda", gpus=(0,)), "/run/worker.json", "/m", "tcp://10.0.0.1:8002", {})
    there = slot.on_node("/node/run", {"KEYS": "/node/run/curve"}, device="cpu")
    argv = there.argv()
    assert flag(argv, "--config") == "/node/run/worker.json" and flag(argv, "--device") == "cpu"
    assert flag(argv, "--address") == "tcp://10.0.0.1:8002" and there.env == {"KEYS": "/node/run/curve"}
    assert flag(slot.on_node("/n", {}).argv(), "--device") == "cuda"
