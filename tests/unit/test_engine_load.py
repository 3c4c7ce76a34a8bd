"""The engine's figures are one typed struct, :class:`worker.contract.protocol.EngineLoad`, from the
heartbeat to the router's worker table: every field reaches the table's row (and its JSON), and a
field added to the struct reaches it with no other edit."""

from __future__ import annotations

import ast
import inspect
import sys
import types

import msgspec

import worker.contract.protocol
from router.admin_protocol import WorkerInfo
from worker.contract.protocol import EngineLoad


def distinct_load(cls: type = EngineLoad) -> dict:
    """A value for every field of ``cls`` that differs from its default and from the others."""
    values = {}
    for k, f in enumerate(msgspec.structs.fields(cls), start=1):
        values[f.name] = k + 0.5 if "float" in str(f.type) else k
    return values


def table_row(proto: types.ModuleType, workers_mod: types.ModuleType, load: dict) -> dict:
    """The admin table's JSON row of worker 0 after one Hello, Ready and a heartbeat carrying ``load``
    (frames through the real encode/decode path)."""
    pool = workers_mod.WorkerPool("inproc://unused", "round_robin", heartbeat_timeout_s=10)
    hello = proto.Hello(
        protocol=proto.PROTOCOL_VERSION, worker_id=0, pid=1, device="cpu[0]", model="m", max_num_seqs=2, max_waiting=0
    )
    for msg in (hello, proto.Ready(worker_id=0, load_seconds=1.0, kv_budget_tokens=10)):
        pool.on_message(0, proto.decode_for_router(proto.encode(msg)))
    beat = proto.Heartbeat(worker_id=0, load=proto.EngineLoad(**load))
    pool.on_message(0, proto.decode_for_router(proto.encode(beat)))
    (row,) = msgspec.json.decode(msgspec.json.encode(pool.table()))["workers"]
    return row


def test_every_figure_of_the_heartbeat_reaches_the_worker_table():
    import router.workers

    load = distinct_load()
    row = table_row(worker.contract.protocol, router.workers, load)
    assert {k: row[k] for k in load} == load
    assert {f.name for f in msgspec.structs.fields(EngineLoad)} <= {f.name for f in msgspec.structs.fields(WorkerInfo)}


def test_a_worker_without_a_heartbeat_reports_the_structs_defaults():
    from router.workers import State, Worker

    row = msgspec.structs.asdict(Worker(0, state=State.STARTING).report())
    assert {k: row[k] for k in distinct_load()} == msgspec.structs.asdict(EngineLoad())


def patched_protocol(field: str) -> types.ModuleType:
    """``worker.contract.protocol`` built from its own source with one more ``EngineLoad`` field, ``field: int = 0``."""
    tree = ast.parse(inspect.getsource(worker.contract.protocol))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineLoad"]
    cls.body.append(ast.parse(f"{field}: int = 0").body[0])
    module = types.ModuleType("worker.contract.protocol")
    module.__file__ = worker.contract.protocol.__file__
    sys.modules["worker.contract.protocol"] = module  # msgspec resolves the annotations through sys.modules
    exec(compile(ast.fix_missing_locations(tree), worker.contract.protocol.__file__, "exec"), module.__dict__)
    return module


def fresh(name: str) -> bool:
    return name in ("worker.contract.protocol", "router") or name.startswith("router.")


def test_a_field_added_to_engine_load_reaches_the_worker_table_with_no_other_edit():
    # The router's modules are imported afresh against a protocol whose EngineLoad has one more
    # field; none of them is edited. The real modules are put back afterwards.
    saved = {n: m for n, m in sys.modules.items() if fresh(n)}
    for name in saved:
        del sys.modules[name]
    try:
        proto = patched_protocol("new_figure")
        import router.workers as fresh_workers

        assert fresh_workers.EngineLoad is proto.EngineLoad
        load = distinct_load(proto.EngineLoad)
        assert "new_figure" in load
        row = table_row(proto, fresh_workers, load)
        assert row["new_figure"] == load["new_figure"] and row["pid"] == 1
    finally:
        for name in [n for n in sys.modules if fresh(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
