"""One tensor-parallel replica's ranks talking to each other: torch.distributed groups, the step
broadcast from rank 0, the all-reduce of the row-parallel layers, and the followers' loop.

Rank 0 owns the ZeroMQ socket, the scheduler and the sampler; ranks 1..N-1 hold their shard and
KV share and run whatever step rank 0 announces (:func:`follow`). Each step rank 0 broadcasts one
int64 message over a gloo group: a two-int header (op, payload length) and the payload in a
fixed-size first tensor, the rest (long block tables) in a second one only when it does not fit.
The payload: the counts (rows, decode rows, chunks), token ids, positions, each decode row's
context length, each prefill chunk's start and end, then the block tables (their lengths, then
their entries). Every rank builds the same attention batch from it
(:func:`worker.attention.build_batch`). Plain tensors only, nothing pickled.

Groups: the ranks meet within :data:`JOIN_TIMEOUT_S` (they are started together); a start-up
group (gloo, ``start_timeout_s``) carries the collectives after loading (the KV-block minimum, a
barrier before the first collective forward), which ranks reach at their own loading speed; a
serving group with ``step_timeout_s`` (``workers.stall_timeout_s``) carries the step messages
(gloo) and the model's all-reduces (gloo on CPU, NCCL on GPU). While idle rank 0 sends a
keep-alive every :data:`KEEPALIVE_S`, so a follower that hears nothing for the step timeout knows
rank 0 is gone. A peer that dies closes its sockets: gloo fails the next collective at once, and
every survivor raises :class:`PeerLost` and exits with :data:`PEER_LOST_EXIT_CODE`.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP, STEP, IDLE = 0, 1, 2
FIRST = 1024  # int64s in a step's first tensor: header + payload of a typical step
KEEPALIVE_S = 1.0
JOIN_TIMEOUT_S = 60.0  # all ranks of a slot start at once; one that has not joined by then is lost
PEER_LOST_EXIT_CODE = 4  # a rank whose peer died or went silent exits with this


class PeerLost(RuntimeError):
    """A collective failed or timed out: another rank of this replica died or hangs."""


class TPGroup:
    """This process's place in a tensor-parallel replica: ``rank`` of ``world``.

    Built by :meth:`init`. ``all_reduce`` is the model's (sum over ranks, in place, float32);
    rank 0 calls ``send_step``/``send_idle``/``send_stop``, the others ``receive``."""

    def __init__(self, rank: int, world: int, device: torch.device, start, control, compute):
        self.rank, self.world, self.device = rank, world, device
        self.start, self.control, self.compute = start, control, compute
        self.last_sent = time.monotonic()

    @classmethod
    def init(
        cls, rank: int, world: int, address: str, device: torch.device, start_timeout_s: float, step_timeout_s: float
    ) -> TPGroup:
        """Join the replica's ranks at ``address`` (``tcp://HOST:PORT``; rank 0 listens there).
        Raises :class:`PeerLost` when the others do not all arrive within :data:`JOIN_TIMEOUT_S`."""
        try:
            dist.init_process_group(
                "gloo", init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=JOIN_TIMEOUT_S)
            )
            start = dist.new_group(backend="gloo", timeout=timedelta(seconds=start_timeout_s))
            step = timedelta(seconds=step_timeout_s)
            control = dist.new_group(backend="gloo", timeout=step)
            compute = dist.new_group(backend="nccl", timeout=step) if device.type == "cuda" else control
        except (RuntimeError, ValueError) as exc:
            raise PeerLost(f"rank {rank}: the {world} ranks did not meet at {address}: {exc}") from exc
        log.info("rank %d of %d joined at %s (%s)", rank, world, address, "nccl" if device.type == "cuda" else "gloo")
        return cls(rank, world, device, start, control, compute)

    def _fail(self, what: str, exc: Exception) -> PeerLost:
        return PeerLost(f"rank {self.rank} of {self.world}: {what} failed, a peer died or hangs: {exc}")

    # ---- the model's collective -------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the row-parallel partial ``t`` [T, hidden], in float32 (so the sum
        rounds once, as the single matmul it replaces does). Every rank gets the same values."""
        t = t.float()
        try:
            dist.all_reduce(t, group=self.compute)
        except RuntimeError as exc:
            raise self._fail("all-reduce", exc) from exc
        return t

    # ---- start-up ---------------------------------------------------------------------

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV block count all of them can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.start)
        except RuntimeError as exc:
            raise self._fail("start-up all-reduce", exc) from exc
        return int(t.item())

    def rank0_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (each passes a list of the same length): the kernel
        choices, so that the ranks of a replica run the kernels rank 0 measured fastest."""
        t = torch.tensor(values, dtype=torch.long)
        try:
            dist.broadcast(t, 0, group=self.start)
        except RuntimeError as exc:
            raise self._fail("start-up broadcast", exc) from exc
        return t.tolist()

    def barrier(self) -> None:
        """Wait, within the start timeout, until every rank is here."""
        self.min_int(0)

    # ---- rank 0: announce the steps ---------------------------------------------------

    def send_step(
        self,
        ids: list[int],
        positions: list[int],
        decode: list[tuple[list[int], int]],
        prefill: list[tuple[list[int], int, int]],
        block_size: int,
    ) -> None:
        """Tell the followers to run this step (:func:`worker.attention.build_batch`'s arguments)."""
        tables = [t[: -(-n // block_size)] for t, n in decode] + [t[: -(-e // block_size)] for t, _, e in prefill]
        payload = [len(ids), len(decode), len(prefill)]
        payload += ids + positions + [n for _, n in decode] + [s for _, s, _ in prefill] + [e for _, _, e in prefill]
        payload += [len(t) for t in tables]
        for t in tables:
            payload += t
        self._send(STEP, payload)

    def send_idle(self) -> None:
        """A keep-alive, when nothing went to the other ranks for :data:`KEEPALIVE_S`."""
        if time.monotonic() - self.last_sent >= KEEPALIVE_S:
            self._send(IDLE, [])

    def send_stop(self) -> None:
        """End the followers' loops (they exit 0). Never raises: a peer already gone is fine here."""
        try:
            self._send(STOP, [])
        except PeerLost as exc:
            log.warning("%s", exc)

    def _send(self, op: int, payload: list[int]) -> None:
        first = torch.zeros(FIRST, dtype=torch.long)
        head = [op, len(payload), *payload[: FIRST - 2]]
        first[: len(head)] = torch.tensor(head, dtype=torch.long)
        try:
            dist.broadcast(first, 0, group=self.control)
            if len(payload) > FIRST - 2:
                dist.broadcast(torch.tensor(payload[FIRST - 2 :], dtype=torch.long), 0, group=self.control)
        except RuntimeError as exc:
            raise self._fail("step broadcast", exc) from exc
        self.last_sent = time.monotonic()

    # ---- ranks 1..N-1: hear them ------------------------------------------------------

    def receive(self) -> tuple[int, tuple | None]:
        """The next message from rank 0: ``(STOP | IDLE, None)`` or ``(STEP, (ids [T], positions
        [T], decode, prefill))`` with ``ids``/``positions`` long tensors on this rank's device."""
        first = torch.empty(FIRST, dtype=torch.long)
        try:
            dist.broadcast(first, 0, group=self.control)
            op, length = int(first[0]), int(first[1])
            if op != STEP:
                return op, None
            payload = first[2 : 2 + length].tolist()
            if length > FIRST - 2:
                rest = torch.empty(length - (FIRST - 2), dtype=torch.long)
                dist.broadcast(rest, 0, group=self.control)
                payload += rest.tolist()
        except RuntimeError as exc:
            raise self._fail("waiting for rank 0's step", exc) from exc
        T, B, C = payload[:3]
        i = 3
        ids, positions = payload[i : i + T], payload[i + T : i + 2 * T]
        i += 2 * T
        lens, starts, ends = payload[i : i + B], payload[i + B : i + B + C], payload[i + B + C : i + B + 2 * C]
        i += B + 2 * C
        sizes = payload[i : i + B + C]
        i += B + C
        tables = []
        for n in sizes:
            tables.append(payload[i : i + n])
            i += n
        decode = list(zip(tables[:B], lens, strict=True))
        prefill = list(zip(tables[B:], starts, ends, strict=True))
        as_long = {"dtype": torch.long, "device": self.device}
        return STEP, (torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), decode, prefill)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def follow(runner, group: TPGroup) -> int:
    """A follower's life once its shard and KV share are allocated: run each step rank 0 sends
    until it says stop. Returns the number of steps run. Raises :class:`PeerLost`."""
    steps = 0
    while True:
        op, step = group.receive()
        if op == STOP:
            return steps
        if op == STEP:
            ids, positions, decode, prefill = step
            runner.forward(ids, positions, decode, prefill, None)
            steps += 1
