"""The supervisor of a deployment of several models: each worker gets its own model's settings and
folder, the router every model's folder, the table each worker's model, and a model's own
``startup_timeout_s`` applies to its replicas."""

from __future__ import annotations

import json

from tests.helpers.supervisor_harness import Harness
from worker.contract.settings import WorkerSettings

MODELS = {
    "models": [
        {"name": "a", "served_name": "chat"},
        {"name": "b", "served_name": "emb", "workers": {"max_num_seqs": 2, "startup_timeout_s": 5}},
    ]
}


def two_models(tmp_path) -> Harness:
    sup = Harness(tmp_path, MODELS, workers=3, models=[0, 0, 1])
    sup.model_paths = [tmp_path / "a", tmp_path / "b"]  # what `up` resolved, one folder per model
    sup.start()
    return sup


def arg_after(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_each_worker_reads_its_own_models_settings_and_folder(tmp_path):
    sup = two_models(tmp_path)
    router, *workers = sup.procs
    assert arg_after(router.args, "--model-path") == [str(tmp_path / "a"), str(tmp_path / "b")]
    for proc, (name, seqs, folder) in zip(workers, [("a", 8, "a"), ("a", 8, "a"), ("b", 2, "b")], strict=True):
        (settings,) = [a for a in proc.args if a.endswith(".json")]
        read = WorkerSettings.model_validate(json.loads(open(settings).read()))
        assert (read.model.name, read.workers.max_num_seqs) == (name, seqs)
        assert str(tmp_path / folder) in proc.args


def test_the_table_names_each_workers_model_from_the_start_report(tmp_path):
    sup = two_models(tmp_path)
    assert [sup.row(wid).model for wid in (0, 1, 2)] == ["chat", "chat", "emb"]


def test_a_models_own_startup_timeout_applies_to_its_replicas(tmp_path):
    sup = two_models(tmp_path)
    sup.tick(6.0)  # past emb's 5 s, within the top-level 60 s
    assert sup.slots[2].kill_reason.startswith("not ready after 5s")
    assert not sup.slots[0].kill_reason and not sup.slots[1].kill_reason
