"""Worker process entry: ``python -m worker.main --config RUN/worker.json --worker-id N ...``.

Only the launcher starts this. It has already put ``CUDA_VISIBLE_DEVICES`` in the environment;
CPU affinity and thread counts are set here before torch is imported.

Tensor parallel: ``--rank R --world-size N --dist-init tcp://127.0.0.1:PORT`` on each of the N
processes of one replica (same ``--worker-id``). Rank 0 listens at ``--dist-init``, is the only one
that talks ZeroMQ (Hello, Ready, heartbeats, tokens) and runs the engine; ranks 1..N-1 load their
shard and run rank 0's steps (:mod:`worker.tp`). A rank whose peer dies or goes silent for
``workers.stall_timeout_s`` exits with :data:`worker.tp.PEER_LOST_EXIT_CODE` (4); ranks 1..N-1
exit 0 when rank 0 stops cleanly, and ignore SIGTERM once loaded (rank 0 decides when they stop).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

from worker.contract.args import WorkerArgs
from worker.contract.env import SLOT_DEVICE_ENV
from worker.contract.fingerprint import system_fingerprint
from worker.contract.heap import freeze_startup_heap
from worker.contract.lifeline import die_with_parent
from worker.contract.logs import setup_logging
from worker.contract.pauses import TurnWatch
from worker.contract.protocol import (
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Embed,
    EngineLoad,
    Generate,
    Hello,
    Ready,
    Shutdown,
)
from worker.contract.settings import WorkerSettings
from worker.core import EngineCore, failed
from worker.node import NodeIdentity

log = logging.getLogger("worker")

# Test hooks, in the style of vLLM's VLLM_TEST_* variables; each names worker ids ("1", "0,2" or
# "all"). CRASH_AT_START: exit with FAULT_EXIT_CODE as soon as the worker starts, before loading
# the model. STALL: the engine loop blocks for good on the first real request (after queueing it)
# while the I/O thread goes on heartbeating, as a stuck CUDA call or a deadlock would.
FAULT_CRASH_AT_START = "LLAMADEPLOY_FAULT_CRASH_AT_START"
FAULT_STALL = "LLAMADEPLOY_FAULT_STALL"
FAULT_EXIT_CODE = 3
LEAVE_LINGER_MS = 2000  # the frames queued at exit get this long to reach the router


def fault_names(variable: str, worker_id: int, env: dict | None = None) -> bool:
    """True when the fault variable ``variable`` names ``worker_id`` (or ``all``)."""
    value = (os.environ if env is None else env).get(variable, "")
    ids = {v.strip() for v in value.split(",")} - {""}
    return "all" in ids or str(worker_id) in ids


def fault_crash_at_start(worker_id: int, env: dict | None = None) -> bool:
    """True when ``LLAMADEPLOY_FAULT_CRASH_AT_START`` names ``worker_id`` (or ``all``)."""
    return fault_names(FAULT_CRASH_AT_START, worker_id, env)


def pin_cpus(cpus: list[int]) -> None:
    """Restrict this process to ``cpus`` and size the math libraries' thread pools to match."""
    os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(len(cpus))


class Link:
    """Rank 0's connection to the router: the ZeroMQ I/O thread (:class:`worker.transport.Transport`,
    which heartbeats :meth:`load`), the engine's sender ``out`` and the ``inbox`` of the router's
    messages; ``engine`` once the replica is loaded."""

    def __init__(self, cfg: WorkerSettings, worker_id: int, address: str):
        from worker.contract.keys import client_keys, uses_curve
        from worker.transport import Transport

        self.worker_id = worker_id
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine = None
        curve = client_keys(worker_id) if uses_curve(address) else None
        self.transport = Transport(address, worker_id, self.inbox, self.load, cfg.workers.heartbeat_s, curve=curve)
        self.transport.start()
        self.out = self.transport.sender()

    def load(self) -> EngineLoad:
        """The engine's figures for a heartbeat (called from the I/O thread: nothing heavy here)."""
        engine = self.engine
        return engine.stats() if engine else EngineLoad()


def run_worker_process(cfg: WorkerSettings, args: WorkerArgs) -> int:
    """Connect to the router, load the replica (rank 0 of ``args.world_size`` tensor-parallel ranks
    meeting at ``args.dist_init``), serve until told to stop, stop. Returns the process exit code.
    ``cfg``: the settings file ``args.config`` (its folder is the run directory)."""
    started = time.monotonic()
    worker_id = args.worker_id
    link = connect(cfg, worker_id, args.device, list(args.cpus), args.address)
    if link is None:
        return 1
    stop = threading.Event()
    catch_signals(link, stop)
    engine, ready, group = load(cfg, link, args, started)
    freeze_startup_heap()  # before the first request: a full collection would pause every stream
    link.engine = engine
    link.transport.announce(ready)
    log.info("ready after %.1fs", time.monotonic() - started)
    loop = Loop(engine, link.out.send, stop, stall_on_request=fault_names(FAULT_STALL, worker_id))
    reason = serve(loop, link.inbox)
    stop_serving(link, engine, group, reason)
    return 0


def connect(cfg: WorkerSettings, worker_id: int, device_kind: str, cpus: list[int], address: str) -> Link | None:
    """Start the I/O thread, say Hello and wait for the CURVE handshake, before loading anything:
    a refused worker fails in seconds. None (logged) when the router refuses or does not answer."""
    from worker.transport import HANDSHAKE_TIMEOUT_S, HandshakeFailed

    link = Link(cfg, worker_id, address)
    link.transport.announce(hello(cfg, worker_id, device_kind, cpus))
    try:
        link.transport.wait_handshake(HANDSHAKE_TIMEOUT_S)
    except HandshakeFailed as exc:
        log.error("%s", exc)
        return None
    return link


def hello(cfg: WorkerSettings, worker_id: int, device_kind: str, cpus: list[int]) -> Hello:
    """Who this worker is: its device (a tensor-parallel slot's is all its ranks'), capacity and node."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    node = NodeIdentity.from_env()
    if where := node.describe():
        log.info("placed on %s, CUDA_VISIBLE_DEVICES=%s", where, visible or "<empty>")
    return Hello(
        protocol=PROTOCOL_VERSION,
        worker_id=worker_id,
        pid=os.getpid(),
        device=os.environ.get(SLOT_DEVICE_ENV)
        or f"{device_kind}[{visible if device_kind == 'cuda' else ','.join(map(str, cpus))}]",
        model=cfg.model.public_name,
        max_num_seqs=cfg.workers.max_num_seqs,
        max_waiting=cfg.workers.max_waiting,
        node_id=node.node_id,
        node_ip=node.node_ip,
        gpu_ids=node.gpu_ids,
    )


def catch_signals(link: Link, stop: threading.Event) -> None:
    """SIGTERM stops at once while loading (nothing in flight), else sets ``stop`` (the loop ends
    and in-flight requests are failed over); SIGINT is ignored: the launcher decides when we stop."""

    def on_sigterm(*_) -> None:
        if link.engine is None:
            raise SystemExit(0)
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def load(cfg: WorkerSettings, link: Link, args: WorkerArgs, started: float):
    """Check the GPUs, resolve and log the load plan (:func:`worker.model.plan_load`), join the
    tensor-parallel ranks, load the weights and KV cache as planned, warm up; with
    ``workers.deterministic`` the replicas of a model share one kernel table
    (:func:`kernel_table`). Returns ``(engine, its Ready message, the rank group or None)``."""
    device_kind, cpus, model_path, world = args.device, args.cpus, args.model_path, args.world_size
    import torch

    from worker import gpus as worker_gpus
    from worker.model import plan_load
    from worker.replica import build_engine, warm_up

    if cpus:
        torch.set_num_threads(len(cpus))
    gpus, share = worker_gpus.start_check(device_kind)  # logs what torch sees; raises on a mismatch
    plan = plan_load(cfg, model_path, device_kind, share, 0, world)  # logged; raises when it cannot load
    if plan.task == "embed":
        from worker.embed.load import load_embedder

        return load_embedder(cfg, link, plan, started)
    group = join_group(cfg, 0, world, args.dist_init, device_kind) if world > 1 else None
    table = kernel_table(cfg, model_path)
    engine, budget = build_engine(cfg, plan, group=group, kernel_table=table)
    log_loaded(cfg, engine, gpus, started)
    warm_up(engine)
    linears = getattr(engine.runner.model, "linears", None)  # None: transformers' forward (no table)
    kernels = linears.report() if linears else []
    ready = Ready(
        worker_id=link.worker_id,
        load_seconds=time.monotonic() - started,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        kv_budget_tokens=budget,
        gpu_uuids=[g["uuid"] for g in gpus],
        block_size=engine.scheduler.blocks.block_size,
        weight_bytes=linears.weight_bytes if linears else 0,
        kernels=kernels,
        fingerprint=system_fingerprint(
            model_path, cfg.model, str(engine.runner.model.dtype), device_kind, world, kernels
        ),
    )
    log.info("system_fingerprint %s", ready.fingerprint)
    return engine, ready, group


def kernel_table(cfg: WorkerSettings, model_path: str) -> Path | None:
    """With ``workers.deterministic``, the kernel table every replica of the model shares on this
    machine, kept across starts (:func:`worker.start_cache.kernel_table_path`). None otherwise: each
    replica measures its own. None under tensor parallel too: the table's lock is held while the
    linears are built, and a rank holding it can wait in a collective for a peer rank that waits for
    the lock (the ranks of two replicas deadlock), so each rank measures its own table there."""
    if not cfg.workers.deterministic or cfg.workers.tensor_parallel_size > 1:
        return None
    from worker.start_cache import kernel_table_path

    return kernel_table_path(model_path)


def log_loaded(cfg: WorkerSettings, engine, gpus: list, started: float) -> None:
    """One line on what was loaded where and the KV cache; on GPU, the memory it takes."""
    log.info(
        "loaded %s as %s on %s in %.1fs; KV cache %d blocks of %d tokens (%.2f GiB)",
        cfg.model.public_name,
        engine.runner.model.dtype,
        engine.device,
        time.monotonic() - started,
        engine.scheduler.blocks.num_blocks,
        engine.scheduler.blocks.block_size,
        engine.runner.cache.nbytes / 2**30,
    )
    if gpus:
        import torch

        from worker import gpus as worker_gpus
        from worker.engine import memory_bytes  # on CPU: RSS (a GPU worker should hold little host memory)

        log.info(
            "GPU memory after loading: %s; host RSS %.2f GiB",
            worker_gpus.memory_report(),
            memory_bytes(torch.device("cpu")) / 2**30,
        )


def stop_serving(link: Link, engine: EngineCore, group, reason: str) -> None:
    """Leave: stop the other ranks, fail what is in flight (503: the router moves it), say Bye
    with ``reason``, flush and stop the I/O thread."""
    if group is not None:
        group.send_stop()
    for request_id in engine.in_flight():
        link.out.send(failed(request_id, 503, f"worker {link.worker_id} is shutting down"))
    link.out.send(Bye(worker_id=link.worker_id, reason=reason))
    link.out.close()
    link.transport.stop()
    link.transport.join(timeout=5)
    log.info("stopped (%s)", reason)


class Loop:
    """The engine loop's receiving side: each message type from the router has one handler
    (SGLang's ``TypeBasedDispatcher``); a handler returns a reason to stop serving, or None.
    Everything the engine returns goes to ``send``."""

    def __init__(self, engine: EngineCore, send, stop: threading.Event, stall_on_request: bool = False):
        self.engine, self.send, self.stop, self.stall_on_request = engine, send, stop, stall_on_request
        self.handlers = {
            Generate: self.on_generate,
            Embed: self.on_embed,
            Cancel: self.on_cancel,
            Shutdown: self.on_shutdown,
        }

    def dispatch(self, msg) -> str | None:
        handler = self.handlers.get(type(msg))
        return handler(msg) if handler is not None else None

    def on_generate(self, msg: Generate) -> str | None:
        log.info(
            "request %s: %d prompt tokens, max_tokens %d%s",
            msg.request_id,
            len(msg.prompt_token_ids),
            msg.params.max_tokens,
            (f", priority {msg.priority}" if msg.priority else "") + (", flex" if msg.flex else ""),
            extra={"request_id": msg.http_request_id},
        )
        return self.submit(msg)

    def on_embed(self, msg: Embed) -> str | None:
        # debug: embeddings come at hundreds a second, and the router logs each one's access line
        log.debug(
            "request %s: %d inputs to embed", msg.request_id, len(msg.inputs), extra={"request_id": msg.http_request_id}
        )
        return self.submit(msg)

    def submit(self, msg: Generate | Embed) -> str | None:
        """Queue a request on the engine; the :data:`FAULT_STALL` hook then blocks until ``stop``."""
        self.send_all(self.engine.submit(msg))
        if self.stall_on_request:
            log.error(
                "%s names this worker: the engine loop stops here, heartbeats go on (fault injection)", FAULT_STALL
            )
            self.stop.wait()
            return "SIGTERM"
        return None

    def on_cancel(self, msg: Cancel) -> None:
        self.engine.cancel(msg.request_id)

    def on_shutdown(self, msg: Shutdown) -> str:
        return msg.reason

    def send_all(self, msgs: list) -> None:
        for out in msgs:
            self.send(out)


def turn_details(engine: EngineCore, handled: int, stepped: bool) -> str:
    """A slow engine turn in words: the messages it handled and the step it took."""
    return f"{handled} messages handled" + (f", {engine.last_step()}" if stepped else "")


def serve(loop: Loop, inbox: queue.SimpleQueue) -> str:
    """The engine loop: take messages, step while there is work, block briefly when idle. Returns
    why it stopped."""
    engine = loop.engine
    watch = TurnWatch("an engine turn")
    while not loop.stop.is_set():
        try:
            msg = inbox.get_nowait() if engine.has_work else inbox.get(timeout=0.2)
        except queue.Empty:
            msg = None
        watch.begin()  # a turn: the messages that arrived, then one step
        handled = 0
        while msg is not None:
            if (reason := loop.dispatch(msg)) is not None:
                return reason
            handled += 1
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                msg = None
        stepped = engine.has_work
        if stepped:
            loop.send_all(engine.step())
        watch.end(partial(turn_details, engine, handled, stepped))
        engine.idle()  # tensor parallel: a keep-alive when no step went out for a second
    return "SIGTERM"


def join_group(cfg: WorkerSettings, rank: int, world: int, dist_init: str, device_kind: str):
    """This process's :class:`worker.tp.TPGroup`: start-up collectives bounded by
    ``workers.startup_timeout_s``, serving ones by ``workers.stall_timeout_s``."""
    import torch

    from worker.tp import TPGroup

    device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
    w = cfg.workers
    return TPGroup.init(rank, world, dist_init, device, w.startup_timeout_s, w.stall_timeout_s)


def run_follower_process(cfg: WorkerSettings, args: WorkerArgs) -> int:
    """Rank ``args.rank`` > 0 of a tensor-parallel replica: join the ranks, load this rank's shard and
    KV share, run rank 0's steps until it says stop (exit 0). Raises :class:`worker.tp.PeerLost`."""
    rank, world, device_kind = args.rank, args.world_size, args.device
    loaded = threading.Event()

    def on_sigterm(*_) -> None:
        if not loaded.is_set():
            raise SystemExit(0)  # still loading: stop now
        log.info("SIGTERM: rank 0 decides when this rank stops")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import torch

    from worker import gpus as worker_gpus
    from worker.model import plan_load
    from worker.replica import build_follower
    from worker.tp import follow

    if args.cpus:
        torch.set_num_threads(len(args.cpus))
    _, share = worker_gpus.start_check(device_kind)
    plan = plan_load(cfg, args.model_path, device_kind, share, rank, world)
    group = join_group(cfg, rank, world, args.dist_init, device_kind)
    runner = build_follower(cfg, plan, group)
    loaded.set()
    log.info(
        "rank %d of %d loaded: KV cache %d blocks (%.2f GiB); following rank 0",
        rank,
        world,
        runner.cache.num_blocks,
        runner.cache.nbytes / 2**30,
    )
    steps = follow(runner, group)
    log.info("rank 0 stopped after %d steps; stopping", steps)
    return 0


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # first: a launcher killed from here on takes this process with it
    args = WorkerArgs.from_argv(argv)
    if args.cpus:
        pin_cpus(list(args.cpus))
    with open(args.config) as f:
        cfg = WorkerSettings.model_validate_json(f.read())
    setup_logging(f"{args.role} {args.device}", cfg.logging.format, cfg.logging.level)
    if fault_crash_at_start(args.worker_id):
        log.error("%s names this worker: exiting with code %d (fault injection)", FAULT_CRASH_AT_START, FAULT_EXIT_CODE)
        sys.exit(FAULT_EXIT_CODE)
    from worker.tp import PEER_LOST_EXIT_CODE, PeerLost

    try:
        code = run_follower_process(cfg, args) if args.rank > 0 else run_worker_process(cfg, args)
    except PeerLost as exc:
        log.error("%s; exiting with code %d", exc, PEER_LOST_EXIT_CODE)
        code = PEER_LOST_EXIT_CODE
    except Exception:
        log.exception("worker failed")
        code = 1
    leave(code)


def leave(code: int) -> None:
    """End this process with ``code`` without the interpreter's teardown: freeing torch's and
    transformers' objects one by one takes seconds (several on a busy CPU), during which the
    supervisor cannot start this slot's replacement and its model's requests wait. What must go
    out goes first: the ZeroMQ frames still queued (Bye, the in-flight requests' failures; at most
    :data:`LEAVE_LINGER_MS`) and the logs."""
    if "zmq" in sys.modules:
        import zmq

        zmq.Context.instance().destroy(linger=LEAVE_LINGER_MS)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
