"""The engine core's shape, read from the source (issue 37): the scheduler is the only writer of a
request's state, both engines implement :class:`worker.core.EngineCore`, and the worker's loop
speaks to an engine only through it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from worker.core import EngineCore

ROOT = Path(__file__).resolve().parents[2]
MUTATORS = {"append", "appendleft", "remove", "pop", "popleft", "clear", "extend", "insert", "sort"}


def tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def chain(node: ast.AST) -> list[str]:
    """``self.scheduler.running`` -> ["self", "scheduler", "running"] (names only, else [])."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def flat(targets: list[ast.AST]) -> list[ast.AST]:
    out = []
    for t in targets:
        out += flat(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return out


def state_writes(module: ast.Module) -> list[str]:
    """Every assignment to an attribute of anything but ``self`` (a sequence's progress, a
    scheduler's budget, ``self.scheduler.x``), and every mutating call on a scheduler's container."""
    found = []
    for node in ast.walk(module):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in flat(targets):
            names = chain(t.value if isinstance(t, ast.Subscript) else t)
            if isinstance(t, ast.Subscript):
                names = names if "scheduler" in names else []  # a dict of its own: self.by_id[...]
            if len(names) > 1 and (len(names) > 2 or names[0] != "self"):
                found.append(f"line {node.lineno}: {'.'.join(names)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            names = chain(node.func)
            if "scheduler" in names[:-2] and names[-1] in MUTATORS:
                found.append(f"line {node.lineno}: {'.'.join(names)}()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            found.append(f"line {node.lineno}: {node.func.id}()")
    return found


def test_the_engine_changes_no_scheduler_or_sequence_state_itself():
    for path in ("worker/engine.py", "worker/replica.py"):
        assert state_writes(tree(path)) == [], path


def test_the_ast_check_catches_what_the_engine_used_to_do():
    old = ast.parse(
        "class Engine:\n"
        "    def _on_oom(self, plan):\n"
        "        s = self.scheduler\n"
        "        s.max_prefill_tokens = 8\n"
        "        self.scheduler.idle_prefill_tokens //= 2\n"
        "        for seq in plan.decode:\n"
        "            seq.computed -= 1\n"
        "        self.scheduler.running.remove(seq)\n"
        "        self.by_id[seq.request_id] = seq\n"
        "        seq.table, self.n = None, 1\n"
    )
    assert len(state_writes(old)) == 5


def protocol_members() -> set[str]:
    return {n for n in vars(EngineCore) if not n.startswith("_")} - {"register"}


def test_both_engines_implement_the_engine_core_protocol():
    from worker.embed.engine import EmbedEngine
    from worker.engine import Engine

    members = protocol_members()
    assert members >= {"submit", "cancel", "has_work", "step", "idle", "in_flight", "stats"}
    for cls in (Engine, EmbedEngine):
        for name in members:
            ours, theirs = getattr(cls, name, None), getattr(EngineCore, name)
            assert ours is not None, (cls.__name__, name)
            assert isinstance(ours, property) == isinstance(theirs, property), (cls.__name__, name)
            if inspect.isfunction(theirs):
                want = len(inspect.signature(theirs).parameters)
                assert len(inspect.signature(ours).parameters) == want, (cls.__name__, name)


def test_the_worker_loop_speaks_to_the_engine_only_through_the_protocol():
    module = tree("worker/main.py")
    members = protocol_members()
    used = set()
    for node in ast.walk(module):
        if (isinstance(node, ast.FunctionDef) and node.name in ("serve", "stop_serving")) or (
            isinstance(node, ast.ClassDef) and node.name == "Loop"
        ):
            for sub in ast.walk(node):
                names = chain(sub) if isinstance(sub, ast.Attribute) else []
                if len(names) >= 2 and names[-2] == "engine":
                    used.add(names[-1])
    assert used and used <= members, used - members


def test_messages_are_dispatched_by_a_type_table():
    import threading

    from worker.contract.protocol import Cancel, Embed, Generate, Shutdown
    from worker.main import Loop

    calls = []

    class Engine:
        def submit(self, msg):
            calls.append(("submit", msg.request_id))
            return ["answer"]

        def cancel(self, request_id):
            calls.append(("cancel", request_id))

    sent = []
    loop = Loop(Engine(), sent.append, threading.Event())
    assert set(loop.handlers) == {Generate, Embed, Cancel, Shutdown}
    assert loop.dispatch(Embed(request_id="e", inputs=[[1]])) is None
    assert loop.dispatch(Cancel(request_id="e")) is None
    assert loop.dispatch(Shutdown(reason="drain")) == "drain"
    assert calls == [("submit", "e"), ("cancel", "e")] and sent == ["answer"]
