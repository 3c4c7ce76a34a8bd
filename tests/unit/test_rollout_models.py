"""``apply`` of a deployment of several models (``models:``), as pure logic: which slots roll, in
which waves, what is refused; and the rollout over fake processes, where the other model's worker
is never touched."""

from __future__ import annotations

import json

import pytest

from launcher.config import DeployConfig, parse_config
from launcher.plan.placement import Inventory
from launcher.rollout.executor import Rollout, Target, replicas_of
from launcher.rollout.plan import Replica, models_changed, plan_models
from tests.helpers.supervisor_harness import Harness
from worker.contract.settings import WorkerSettings

GIB = 2**30
CHAT, EMB = "smollm2", "minilm"


def two(chat: dict | None = None, emb: dict | None = None, **sections) -> DeployConfig:
    """Chat (2 replicas) beside embeddings (1 replica) on CPU; ``chat``/``emb``: keys of each entry."""
    base = {
        "models": [
            {"name": "chat-model", "served_name": CHAT, "workers": {"replicas": 2}, **(chat or {})},
            {"name": "emb-model", "served_name": EMB, "task": "embed", **(emb or {})},
        ],
        "workers": {"devices": "cpu", "replicas": 1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return parse_config(base)


def running(free: int = 0) -> list[Replica]:
    """Slots 0 and 1 serve chat, slot 2 embeddings, all on revision 1."""
    return [Replica(0, CHAT, 1, free_bytes=free), Replica(1, CHAT, 1, free_bytes=free), Replica(2, EMB, 1)]


def plan(new: DeployConfig, free: int = 0, counts: dict | None = None, **kw):
    counts = counts or {CHAT: 2, EMB: 1}
    return plan_models(two(), new, running(free), counts, dict.fromkeys(counts, GIB), revision=2, **kw)


def test_a_change_of_one_models_entry_rolls_its_replicas_only_one_per_wave():
    p = plan(two(chat={"workers": {"replicas": 2, "max_num_seqs": 3}}), free=2 * GIB)
    assert [(s.kind, s.worker_id, s.group, s.wave, s.mode) for s in p.steps] == [
        ("replace", 0, CHAT, 0, "surge"),
        ("replace", 1, CHAT, 1, "surge"),
    ]
    assert p.rolling == (f"workers.max_num_seqs ({CHAT})",) and p.live == () and p.fixed == ()
    assert f"rolling (each replica replaced): workers.max_num_seqs ({CHAT})" in p.lines()


def test_a_top_level_worker_key_rolls_every_model_one_model_after_the_other():
    p = plan(two(workers={"max_num_seqs": 4}), counts={CHAT: 2, EMB: 1})
    assert [(s.worker_id, s.group, s.wave) for s in p.steps] == [(0, CHAT, 0), (1, CHAT, 1), (2, EMB, 2)]
    assert all(s.mode == "drain_first" for s in p.steps)  # no memory free beside them
    # the lone embedding replica may not go out of service: its drain-first is warned about
    assert any("--max-unavailable is 0" in w for w in p.warnings)


def test_the_embedding_model_alone_rolls_and_the_chat_replicas_stay():
    p = plan(two(emb={"max_model_len": 128}))
    assert [(s.kind, s.worker_id, s.wave) for s in p.steps] == [("replace", 2, 0)]
    assert p.rolling == (f"model.max_model_len ({EMB})",)


def test_router_keys_are_live_once_and_replace_nothing():
    p = plan(two(router={"policy": "round_robin"}, supervisor={"drain_timeout_s": 5}))
    assert p.live == ("router.policy", "supervisor.drain_timeout_s") and p.steps == ()


def test_a_models_replica_count_scales_that_model():
    p = plan(two(emb={"workers": {"replicas": 2}}), counts={CHAT: 2, EMB: 2})
    assert [(s.kind, s.worker_id, s.group, s.wave) for s in p.steps] == [("start", 3, EMB, 0)]


def test_max_unavailable_bounds_each_model():
    p = plan(two(workers={"max_num_seqs": 4}), max_unavailable=2)
    assert [(s.worker_id, s.wave) for s in p.steps] == [(0, 0), (1, 0), (2, 1)]


def test_a_fixed_key_is_named_once():
    p = plan(two(router={"port": 9000}))
    assert p.fixed == ("router.port",)


@pytest.mark.parametrize(
    "entries",
    [
        [{"name": "chat-model", "served_name": CHAT}],  # one removed
        [
            {"name": "chat-model", "served_name": CHAT},
            {"name": "emb-model", "served_name": EMB, "task": "embed"},
            {"name": "other"},
        ],  # one added
        [{"name": "emb-model", "served_name": EMB, "task": "embed"}, {"name": "chat-model", "served_name": CHAT}],
        [{"name": "chat-model", "served_name": "chat2"}, {"name": "emb-model", "served_name": EMB, "task": "embed"}],
    ],
    ids=["removed", "added", "reordered", "renamed"],
)
def test_which_models_are_served_cannot_change(entries):
    new = parse_config({"models": entries, "workers": {"devices": "cpu"}})
    problem = models_changed(two(), new)
    assert problem and "needs `llamadeploy up` again" in problem and f"{CHAT}, {EMB} -> " in problem
    with pytest.raises(ValueError, match="adding, removing, renaming or reordering"):
        plan(new)


def test_one_model_may_still_be_renamed():
    old = parse_config({"model": {"name": "tiny"}})
    assert models_changed(old, parse_config({"model": {"name": "tiny", "served_name": "t2"}})) is None
    assert models_changed(old, parse_config({"models": [{"name": "tiny"}]})) is None


# ---- the rollout over fake processes -----------------------------------------------------

MODELS = {
    "models": [
        {"name": "a", "served_name": "chat"},
        {"name": "b", "served_name": "emb", "workers": {"max_num_seqs": 2}},
    ]
}


def test_the_rollout_replaces_the_chat_worker_and_moves_the_embedding_worker_without_a_restart(tmp_path):
    sup = Harness(tmp_path, MODELS, workers=2, models=[0, 1])
    sup.model_paths = [tmp_path / "a", tmp_path / "b"]
    sup.start()
    for wid in (0, 1):
        sup.ready(wid)
    emb_pid = sup.proc_of(1).pid
    old_rev = sup.revisions.current
    data = old_rev.config.model_dump(mode="json", exclude={"model"})
    data["models"][0]["workers"] = {"max_num_seqs": 3}
    new_cfg = DeployConfig.model_validate(data)
    inventory = Inventory(cpus=[0, 1, 2, 3], ram_available_bytes=8 * GIB)
    p = plan_models(
        old_rev.config,
        new_cfg,
        replicas_of(sup, inventory),
        {"chat": 1, "emb": 1},
        {"chat": GIB, "emb": GIB},
        revision=2,
    )
    assert [(s.kind, s.worker_id, s.mode) for s in p.steps] == [("replace", 0, "surge")]
    new_rev = sup.revisions.record(new_cfg)
    files = (tmp_path / "worker-r2.json", tmp_path / "worker-r2-1.json")
    for k, path in enumerate(files):
        path.write_text(new_cfg.worker_settings(k).model_dump_json())
    old = Target(old_rev, tuple(sup.worker_settings_paths), tuple(sup.model_paths))
    sup.rollout = ro = Rollout(sup, "r1", old, Target(new_rev, files, tuple(sup.model_paths)), p, inventory, 0)
    sup.tick()
    assert set(sup.slots) == {0, 1, 2} and sup.slots[2].spec.model == 0 and sup.slots[2].spec.cpus == (2,)
    sup.ready(2)
    sup.tick()
    sup.proc_of(0).exit(0)  # the drained chat worker exits as told: its slot is retired
    for _ in range(3):
        sup.tick(0.2)
    assert sup.rollout is None and ro.state == "done" and set(sup.slots) == {1, 2}
    (settings,) = [a for a in sup.procs[-1].args if a.endswith(".json")]
    assert WorkerSettings.model_validate(json.loads(open(settings).read())).workers.max_num_seqs == 3
    assert str(tmp_path / "a") in sup.procs[-1].args  # the chat model's folder
    emb = sup.slots[1]
    assert emb.proc.pid == emb_pid and emb.starts == 1  # never restarted
    assert (emb.revision, emb.settings_path, emb.model_path) == (2, files[1], tmp_path / "b")  # its next start
    assert sup.row(1).revision == 2 and sup.row(2).revision == 2
