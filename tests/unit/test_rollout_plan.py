"""The diff → plan function of ``llamadeploy apply`` (pure logic: no process, no I/O)."""

from __future__ import annotations

import pytest

from launcher.config import parse_config
from launcher.rollout.plan import Replica, changed_keys, classify, plan_rollout

GIB = 2**30


def cfg(**sections):
    base = {"model": {"name": "tiny"}, "workers": {"devices": "cpu", "replicas": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return parse_config(base)


def replicas(n, free=0, ready=True, group="tiny"):
    return [Replica(i, group, revision=1, ready=ready, free_bytes=free) for i in range(n)]


def test_router_and_supervisor_keys_are_live_and_replace_nothing():
    new = cfg(
        router={"policy": "round_robin", "api_keys": ["k2"], "admin_token": "t2", "request_timeout_s": 9},
        limits={"max_tokens": 7},
        logging={"level": "debug"},
        supervisor={"drain_timeout_s": 5},
    )
    plan = plan_rollout(cfg(), new, replicas(2), new_replicas=2, need_bytes=GIB)
    assert set(plan.live) == {
        "router.policy",
        "router.api_keys",
        "router.admin_token",
        "router.request_timeout_s",
        "limits.max_tokens",
        "logging.level",
        "supervisor.drain_timeout_s",
    }
    assert plan.rolling == () and plan.steps == () and plan.fixed == ()


def test_what_a_worker_loads_or_is_started_with_rolls():
    keys = changed_keys(
        cfg(),
        cfg(model={"dtype": "bfloat16", "max_model_len": 512, "quantization": "int8"}, workers={"max_num_seqs": 2}),
    )
    live, rolling, fixed = classify(keys)
    assert live == () and fixed == ()
    assert set(rolling) == {"model.dtype", "model.max_model_len", "model.quantization", "workers.max_num_seqs"}
    assert classify(["model.name", "workers.kv_cache_gib", "workers.tensor_parallel_size"]) == (
        (),
        ("model.name", "workers.kv_cache_gib"),
        ("workers.tensor_parallel_size",),  # a new placement: `up` again
    )


def test_addresses_and_the_cluster_cannot_change_live():
    new = cfg(router={"port": 9000}, logging={"format": "json"}, limits={"max_body_bytes": 4096})
    plan = plan_rollout(cfg(), new, replicas(2), 2, GIB)
    assert plan.fixed == ("limits.max_body_bytes", "logging.format", "router.port")
    assert [p.split(":")[0] for p in plan.problems()] == list(plan.fixed)


def test_one_replica_at_a_time_by_default_drain_first_without_room():
    plan = plan_rollout(cfg(), cfg(workers={"max_num_seqs": 2}), replicas(2, free=0), 2, GIB)
    assert plan.max_unavailable == 1
    assert [(s.kind, s.worker_id, s.mode, s.wave) for s in plan.steps] == [
        ("replace", 0, "drain_first", 0),
        ("replace", 1, "drain_first", 1),
    ]


def test_surge_where_the_free_memory_holds_a_second_copy():
    reps = [Replica(0, "tiny", 1, free_bytes=2 * GIB), Replica(1, "tiny", 1, free_bytes=GIB // 2)]
    plan = plan_rollout(cfg(), cfg(model={"dtype": "float32"}), reps, 2, need_bytes=GIB)
    assert [(s.worker_id, s.mode) for s in plan.steps] == [(0, "surge"), (1, "drain_first")]


def test_max_unavailable_groups_replacements_into_waves():
    plan = plan_rollout(cfg(), cfg(workers={"max_num_seqs": 2}), replicas(5), 5, GIB, max_unavailable=2)
    assert [s.wave for s in plan.steps] == [0, 0, 1, 1, 2]


def test_replicas_not_ready_are_replaced_first():
    reps = [Replica(0, "tiny", 1), Replica(1, "tiny", 1, ready=False), Replica(2, "tiny", 1)]
    plan = plan_rollout(cfg(), cfg(workers={"max_num_seqs": 2}), reps, 3, GIB)
    assert [s.worker_id for s in plan.steps] == [1, 0, 2]


def test_one_replica_without_room_warns_that_it_drains_first():
    one = cfg(workers={"replicas": 1})
    plan = plan_rollout(one, cfg(workers={"replicas": 1, "max_num_seqs": 2}), replicas(1), 1, GIB)
    assert plan.max_unavailable == 0
    assert plan.steps[0].mode == "drain_first" and plan.warnings
    roomy = plan_rollout(one, cfg(workers={"replicas": 1, "max_num_seqs": 2}), replicas(1, free=GIB), 1, GIB)
    assert roomy.steps[0].mode == "surge" and not roomy.warnings


def test_scale_up_starts_new_slots_and_scale_down_stops_the_newest_first():
    up = plan_rollout(cfg(), cfg(workers={"replicas": 4}), replicas(2), 4, GIB)
    assert [(s.kind, s.worker_id) for s in up.steps] == [("start", 2), ("start", 3)]
    assert up.rolling == () and up.live == ()
    down = plan_rollout(cfg(workers={"replicas": 3}), cfg(workers={"replicas": 1}), replicas(3), 1, GIB)
    assert [(s.kind, s.worker_id) for s in down.steps] == [("stop", 2), ("stop", 1)]


def test_scale_down_with_a_rolling_change_replaces_only_what_stays():
    plan = plan_rollout(cfg(workers={"replicas": 3}), cfg(model={"dtype": "float32"}), replicas(3), 2, GIB)
    assert [(s.kind, s.worker_id, s.wave) for s in plan.steps] == [
        ("stop", 2, 0),
        ("replace", 0, 1),
        ("replace", 1, 2),
    ]


def test_a_renamed_model_replaces_every_replica_into_the_new_group():
    plan = plan_rollout(cfg(), cfg(model={"served_name": "chat"}), replicas(2), 2, GIB)
    assert plan.rolling == ("model.served_name",)
    assert {s.group for s in plan.steps} == {"chat"} and len(plan.steps) == 2


def test_nothing_changed_is_an_empty_plan():
    plan = plan_rollout(cfg(), cfg(), replicas(2), 2, GIB)
    assert plan.empty and plan.lines() == ["nothing to change"]


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="max-unavailable"):
        plan_rollout(cfg(), cfg(), replicas(2), 2, GIB, max_unavailable=-1)
    with pytest.raises(ValueError, match="at least one replica"):
        plan_rollout(cfg(), cfg(), replicas(2), 0, GIB)


def test_the_printed_plan_names_each_step():
    plan = plan_rollout(cfg(), cfg(workers={"max_num_seqs": 2}, router={"policy": "round_robin"}), replicas(2), 2, GIB)
    assert plan.lines() == [
        "live (no restart): router.policy",
        "rolling (each replica replaced): workers.max_num_seqs",
        "wave 0: replace worker 0 (drain_first: drain, then start the new one)",
        "wave 1: replace worker 1 (drain_first: drain, then start the new one)",
    ]
