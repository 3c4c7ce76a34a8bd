"""``cluster.backend: ray``: the supervisor's worker slots as Ray actors pinned to placement groups.

:class:`RayBackend` is what ``Supervisor(..., backend=...)`` calls to start a slot: it returns a
:class:`RayWorker`, a handle with ``subprocess.Popen``'s interface over one
:class:`~launcher.ray.actor.WorkerActor`, so restarts with backoff, ``failed`` after too many
crashes, drain and ``restart-worker``, hung-worker kills and graceful shutdown are the
supervisor's own, as locally.

Placement groups (how vLLM and Ray Serve LLM reserve GPUs): one ``STRICT_PACK`` group per node,
one bundle per slot placed there, each bundle pinned to its node by the ``ray.io/node-id`` label,
made once at start. A restarted worker gets a new actor in its slot's bundle, so it lands on the
same node with the same reservation. When that node has left the cluster, the slot is re-placed: a
new one-bundle group wherever Ray finds room within ``cluster.placement_timeout_s``, else
:class:`~launcher.supervise.supervisor.WorkerStartError` marks the slot ``failed`` with the reason.

Test switch: :data:`GPUS_ON_CPU_ENV` in the launcher's environment makes workers that Ray granted
GPUs compute on CPU (their ``CUDA_VISIBLE_DEVICES`` is still Ray's), for clusters whose GPUs are
declared (``ray start --num-gpus``) rather than real.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from launcher.config import DeployConfig
from launcher.ray.actor import RUN_DIR, WorkerActor
from launcher.ray.placement import RaySpec
from launcher.supervise.launch import WorkerLaunch
from launcher.supervise.supervisor import WorkerStartError
from worker.contract.args import WorkerArgs
from worker.contract.env import KEYS_ENV
from worker.contract.keys import ROUTER, worker_name

log = logging.getLogger(__name__)

GPUS_ON_CPU_ENV = "LLAMADEPLOY_TEST_GPUS_ON_CPU"  # test only: Ray's GPUs are declared, the model runs on CPU
NODE_LABEL = "ray.io/node-id"
ACTOR_CONCURRENCY = 4  # wait() blocks one thread; signals and info take others


class RayWorker:
    """Popen's interface over one worker actor. ``pid`` is the worker process's (on its node);
    ``returncode`` is set once ``wait()`` on the actor returned (the worker's code) or failed (the
    actor died: ``-SIGKILL``, with :attr:`exit_reason` saying why, e.g. its node left)."""

    def __init__(self, backend: RayBackend, wid: int, actor, info: dict):
        import ray

        self.backend, self.wid, self.actor, self.info = backend, wid, actor, info
        self.pid: int = info["pid"]
        self.node_id: str = info["node_id"]
        spec = backend.specs[wid]
        what = f"gpu[{','.join(info['gpu_ids'])}]" if info["gpu_ids"] else f"cpu×{spec.bundle_cpus}"
        self.label = f"ray {info['node_ip']} ({self.node_id[:8]}) {what}"  # where it runs (the supervisor shows it)
        self.returncode: int | None = None
        self.exit_reason = ""
        self._killed = False
        self._done = actor.wait.remote()
        self._ray = ray

    def _finish(self) -> None:
        ray = self._ray
        try:
            code = ray.get(self._done)
        except ray.exceptions.RayError as exc:
            code = -signal.SIGKILL
            if not self._killed:
                self.exit_reason = self.backend.death_reason(self.node_id, exc)
        self.returncode = code
        ray.kill(self.actor, no_restart=True)  # frees the bundle for the next start

    def poll(self) -> int | None:
        if self.returncode is None and self._ray.wait([self._done], timeout=0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ray.wait([self._done], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired(f"ray worker {self.wid}", timeout)
            self._finish()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill()
        elif self.returncode is None:
            self.actor.send_signal.remote(int(sig))

    def kill(self) -> None:
        if self.returncode is None:
            self._killed = True
            self._ray.kill(self.actor, no_restart=True)  # the worker dies with its actor (PR_SET_PDEATHSIG)


class ExitedWorker:
    """The handle of a start whose actor died before the worker ran: a crash to the supervisor."""

    pid = 0
    label = ""

    def __init__(self, reason: str):
        self.returncode, self.exit_reason = -signal.SIGKILL, reason

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


class RayBackend:
    """Starts worker slots as Ray actors (see the module doc). ``specs`` come from
    :func:`launcher.ray.placement.place_on_cluster`; the process must be connected to Ray."""

    def __init__(self, cfg: DeployConfig, specs: list[RaySpec], gpus_on_cpu: bool | None = None):
        import ray
        from ray.util.placement_group import placement_group

        self.cfg = cfg
        self.timeout = cfg.cluster.placement_timeout_s
        self.gpus_on_cpu = bool(os.environ.get(GPUS_ON_CPU_ENV)) if gpus_on_cpu is None else gpus_on_cpu
        self._ray = ray
        self._actor_cls = ray.remote(max_restarts=0, max_concurrency=ACTOR_CONCURRENCY)(WorkerActor)
        self.specs = {s.worker_id: s for s in specs}
        self.home: dict[int, tuple] = {}  # worker id -> (group, bundle index, node id)
        by_node: dict[str, list[RaySpec]] = {}
        for s in specs:
            by_node.setdefault(s.node_id, []).append(s)
        for node, slots in by_node.items():
            group = placement_group(
                [s.bundle for s in slots],
                strategy="STRICT_PACK",
                bundle_label_selector=[{NODE_LABEL: node}] * len(slots),
            )
            for i, s in enumerate(slots):
                self.home[s.worker_id] = (group, i, node)
        log.info(
            "Ray: %d placement group(s), one per node: %s",
            len(by_node),
            ", ".join(f"{n[:8]}: worker(s) {[s.worker_id for s in v]}" for n, v in by_node.items()),
        )

    # ---- nodes ------------------------------------------------------------------------

    def alive_nodes(self) -> dict[str, dict]:
        return {n["NodeID"]: n for n in self._ray.nodes() if n.get("Alive")}

    def death_reason(self, node_id: str, exc: Exception) -> str:
        """Why an actor died: its node left the cluster, or the actor process itself died."""
        if node_id not in self.alive_nodes():
            return f"its Ray node {node_id[:8]} left the cluster"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"its Ray actor died ({first[:200]})"

    def _free_per_node(self) -> dict[str, dict] | None:
        """Resources not reserved on each alive node, or None (:func:`launcher.ray.cluster.free_resources`)."""
        from launcher.ray.cluster import free_resources

        return free_resources()

    def _free_now(self, free: dict[str, dict] | None = None) -> str:
        free = self._free_per_node() if free is None else free
        parts = [f"{n[:8]}: GPU {r.get('GPU', 0):g}, CPU {r.get('CPU', 0):g}" for n, r in (free or {}).items()]
        return "; free now: " + ", ".join(parts) if parts else ""

    def _home(self, spec: RaySpec) -> tuple:
        """The slot's (group, bundle, node), re-placed when its node has left. Raises WorkerStartError."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        group, index, node = self.home[spec.worker_id]
        if group is not None and node in self.alive_nodes():
            if not group.wait(timeout_seconds=self.timeout):
                raise WorkerStartError(
                    f"Ray did not grant worker {spec.worker_id}'s reservation {spec.bundle} on node {node[:8]} "
                    f"within {self.timeout:.0f}s (cluster.placement_timeout_s){self._free_now()}"
                )
            return group, index, node
        log.warning("worker %d: its Ray node %s left the cluster; placing it on another node", spec.worker_id, node[:8])
        if group is not None and all(h[0] is not group for w, h in self.home.items() if w != spec.worker_id):
            remove_placement_group(group)
        self.home[spec.worker_id] = (None, 0, node)
        free = self._free_per_node()
        if free is not None and not any(all(r.get(k, 0) >= v for k, v in spec.bundle.items()) for r in free.values()):
            raise WorkerStartError(  # known at once: no need to hold the supervisor for the timeout
                f"its Ray node {node[:8]} left the cluster and no other node has room for {spec.bundle}"
                f"{self._free_now(free)}; add a node, then `llamadeploy restart-worker {spec.worker_id}`"
            )
        moved = placement_group([spec.bundle], strategy="STRICT_PACK")
        if not moved.wait(timeout_seconds=self.timeout):
            remove_placement_group(moved)
            raise WorkerStartError(
                f"its Ray node {node[:8]} left the cluster and no other node has room for {spec.bundle} within "
                f"{self.timeout:.0f}s (cluster.placement_timeout_s){self._free_now()}; add a node, then "
                f"`llamadeploy restart-worker {spec.worker_id}`"
            )
        new_node = placement_group_table(moved)["bundles_to_node_id"][0]
        log.info("worker %d re-placed on Ray node %s", spec.worker_id, new_node[:8])
        self.home[spec.worker_id] = (moved, 0, new_node)
        return moved, 0, new_node

    # ---- starting ---------------------------------------------------------------------

    def _payload(self, spec: RaySpec, launch: WorkerLaunch) -> tuple[WorkerArgs, dict, dict]:
        """The worker's arguments and environment with node-local paths, and the files to write
        there: its settings file (no router secret is in it) and its CURVE keys."""
        files = {"worker.json": Path(launch.args.config).read_bytes()}
        env = {k: v for k, v in launch.env.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        if KEYS_ENV in env:
            keys = Path(env[KEYS_ENV])
            for name in (f"{worker_name(spec.worker_id)}.public", f"{worker_name(spec.worker_id)}.secret"):
                files[f"curve/{name}"] = (keys / name).read_bytes()
            files[f"curve/{ROUTER}.public"] = (keys / f"{ROUTER}.public").read_bytes()
            env[KEYS_ENV] = f"{RUN_DIR}/curve"
        there = launch.on_node(RUN_DIR, env, "cpu" if self.gpus_on_cpu else None)
        return there.args, dict(there.env), files

    def spawn_worker(self, spec: RaySpec, launch: WorkerLaunch):
        """Start worker ``spec`` in its bundle; blocks until its process runs (at most
        ``cluster.placement_timeout_s``). Raises WorkerStartError when no node can hold it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        spec = self.specs[spec.worker_id]
        group, index, _node = self._home(spec)
        worker_args, worker_env, files = self._payload(spec, launch)
        actor = self._actor_cls.options(
            num_cpus=spec.bundle_cpus,
            num_gpus=spec.bundle_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        start = actor.start.remote(worker_args, worker_env, files, spec.share, self.gpus_on_cpu)
        try:
            info = ray.get(start, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            return ExitedWorker(f"its Ray actor did not start within {self.timeout:.0f}s (cluster.placement_timeout_s)")
        except ray.exceptions.RayError as exc:
            ray.kill(actor, no_restart=True)
            return ExitedWorker(self.death_reason(_node, exc))
        log.info(
            "worker %d: Ray node %s (%s), GPU ids [%s], CUDA_VISIBLE_DEVICES=%s, pid %d",
            spec.worker_id,
            info["node_ip"],
            info["node_id"][:8],
            ",".join(info["gpu_ids"]),
            info["cuda_visible_devices"] or '""',
            info["pid"],
        )
        return RayWorker(self, spec.worker_id, actor, info)

    def close(self) -> None:
        """Release every placement group and leave the cluster (the actors are gone by then)."""
        from ray.util.placement_group import remove_placement_group

        ray = self._ray
        for group, *_ in {id(h[0]): h for h in self.home.values() if h[0] is not None}.values():
            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 (already gone with its node: nothing to release)
                log.debug("placement group: %s", exc)
        ray.shutdown()
