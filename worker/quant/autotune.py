"""The kernel of each linear layer, chosen by measurement on the machine the worker starts on.

No kernel is fastest on every CPU and every row count (which of MKL's sgemm, oneDNN's prepacked
kernel and int8 weight-only wins depends on the CPU and on the rows; the docs' benchmark results
hold what was measured where), so nothing here assumes a vendor's speed. For each distinct weight (shape and format) of the model and each row-count
*bucket* a step can produce (1, 2, 4, … up to the scheduler's largest step, capped at
:data:`MAX_TUNED_ROWS`), every eligible candidate (:func:`worker.quant.kernels.check`) is timed —
:data:`WARMUP` calls, then the best of :data:`REPEATS` (other processes on the machine only ever
add time to a call, so the best is the steadiest estimate of the kernel's own) — and the fastest is
picked. At run time a
step of T rows runs the pick of the smallest bucket ≥ T (beyond the last bucket, the last's).

A second form of a weight (a plain float weight beside its prepacked one, say) is kept only where
the table says it pays: the *primary* kernel is the one that wins the most buckets, and another
holding other tensors replaces it in a bucket only when it is at least :data:`MIN_GAIN` faster
there, and at all only when the time it saves over the buckets it runs is at least
:data:`MIN_GAIN` of the primary's time summed over every bucket per copy of the weight it adds
(a copy that saves little over the whole table costs its memory for nothing). Candidates that hold a float copy of a quantized weight (``Candidate.copy``) are left out
unless ``allow_copies``: quantization is for memory.

On a CPU the candidates are timed on one thread by that thread's CPU clock (:func:`cpu_timing`),
for every caller (the chat engine's linears and the embedding encoder's): on a busy CPU a wall-clock
timing on several threads measures OpenMP barriers waiting for a descheduled thread, not the
kernel, while a thread's CPU time counts only what it computed. Every candidate splits its output rows over threads alike, so their ranking on one thread
is the ranking on several. Each of those timed calls starts with the weight out of the caches
(:func:`cache_evictor`), as a decode step finds it: the step reads every weight once, far more bytes
than the last-level cache holds, so a kernel timed on a weight left in the cache by its previous
call would be ranked by its arithmetic at one row, where what decides is how fast it streams the
weight from memory. The timer is injectable, so the choice logic is unit-tested with a fake
clock.

Each candidate says whether it is row-count invariant (:attr:`~worker.quant.kernels.Candidate.invariant`),
and so does each :class:`Choice` (:attr:`Choice.invariant`: one such kernel at every bucket). The
replicas of a model can share one table (:func:`load_or_measure`, kept across starts by
:mod:`worker.start_cache`): measured once, read by the next replica, so they all run the same kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from worker.quant import invariance
from worker.quant.format import QuantizedWeight
from worker.quant.kernels import Candidate, Kernel, Weight, candidates, check, storage_key

log = logging.getLogger(__name__)

WARMUP = 2  # untimed calls first: oneDNN builds its primitive, caches warm
REPEATS = 5  # timed calls; the best is the figure
MAX_TUNED_ROWS = 128  # larger steps (a big prefill) run the largest bucket's pick: compute-bound there
SLOW_ROUND_S = 0.05  # past this per round of calls, two rounds are enough
PRUNE = 8.0  # a kernel this many times slower than the best at a bucket is not timed at larger ones
MIN_GAIN = 0.10  # a second form of a weight must be at least this much faster where it is used
# a quantized weight's values are held once (quantization is for memory): a second form may add a
# copy of its scales (int8pack's bfloat16 ones), not another layout of its values
MAX_ADDED_QUANTIZED = 0.25
LLC_DEFAULT = 32 * 2**20  # bytes, where the CPU's caches are not listed
EVICT_FACTOR = 1.5  # a buffer this many times the last-level cache empties it of the weight timed


def buckets(max_rows: int) -> list[int]:
    """Powers of two from 1 up to the first ≥ ``max_rows`` (at most :data:`MAX_TUNED_ROWS`)."""
    out = [1]
    while out[-1] < min(max_rows, MAX_TUNED_ROWS):
        out.append(out[-1] * 2)
    return out


@dataclass
class Pick:
    """The kernel a bucket runs: steps of up to ``rows`` rows; ``seconds``: its time per call
    (NaN where nothing was timed: only one candidate was eligible)."""

    rows: int
    kernel: str
    seconds: float


@dataclass
class Choice:
    """What was measured for one weight shape and format: ``picks`` per bucket, and every timed
    candidate's time per bucket (``times[name][rows]``) for the log."""

    n: int
    k: int
    weight: str
    picks: list[Pick]
    times: dict[str, dict[int, float]] = field(default_factory=dict)
    eligible: list[str] = field(default_factory=list)
    invariant: bool = False  # one row-count-invariant kernel runs every bucket

    def kernels(self) -> list[str]:
        """The distinct kernels the picks use, in bucket order."""
        return list(dict.fromkeys(p.kernel for p in self.picks))


def best_times(
    fns: list[Callable],
    x: torch.Tensor,
    timer: Callable[[], float],
    sync: Callable[[], None],
    evict: Callable[[], None] | None = None,
) -> list[float]:
    """The fastest of :data:`REPEATS` calls of each ``fn(x)`` (two when a round of them takes over
    :data:`SLOW_ROUND_S`), in seconds, after :data:`WARMUP` calls each. The calls take turns (one of each per round), so a burst of load from other
    processes slows every candidate alike instead of one of them. ``evict``, where given, runs
    before each timed call, untimed (:func:`cache_evictor`)."""
    for fn in fns:
        for _ in range(WARMUP):
            fn(x)
    sync()
    best = [float("inf")] * len(fns)
    for rep in range(REPEATS):
        if rep == 2 and sum(best) > SLOW_ROUND_S:
            break  # slow calls vary less, and the start-up is waiting: two rounds will do
        for i, fn in enumerate(fns):
            if evict is not None:
                evict()
            start = timer()
            fn(x)
            sync()
            best[i] = min(best[i], timer() - start)
    return best


@contextlib.contextmanager
def cpu_timing() -> Iterator[Callable[[], float]]:
    """Within the block torch runs on one thread; yields that thread's CPU clock (``time.thread_time``,
    seconds): what the tuner times CPU kernels by. The thread count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield time.thread_time
    finally:
        torch.set_num_threads(before)


def measure(
    kernels: list[Kernel],
    k: int,
    rows: list[int],
    dt: torch.dtype,
    device: torch.device,
    timer: Callable[[], float] | None = None,
) -> dict[str, dict[int, float]]:
    """``times[name][rows]`` for each kernel and bucket, buckets ascending; a kernel :data:`PRUNE`
    times slower than the best at one bucket is not timed at the larger ones. ``timer`` None: on a CPU
    one thread's CPU clock (:func:`cpu_timing`), on CUDA the wall clock after a synchronize."""
    if timer is None and device.type == "cpu":
        with cpu_timing() as clock:
            weight = min(sum(_nbytes(t) for t in _distinct(kn.held)) for kn in kernels)
            return _measure(kernels, k, rows, dt, device, clock, cache_evictor(weight))
    return _measure(kernels, k, rows, dt, device, timer or time.perf_counter)


def _measure(kernels, k, rows, dt, device, timer, evict=None) -> dict[str, dict[int, float]]:
    """:func:`measure` by ``timer``, each timed call after ``evict`` where given."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, dict[int, float]] = {kn.name: {} for kn in kernels}
    alive = list(kernels)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, k, generator=g).to(device=device, dtype=dt)
            for kn, t in zip(alive, best_times([kn.fn for kn in alive], x, timer, sync, evict), strict=True):
                times[kn.name][r] = t
            best = min(times[kn.name][r] for kn in alive)
            alive = [kn for kn in alive if times[kn.name][r] <= PRUNE * best]
    return times


def last_level_cache_bytes() -> int:
    """This CPU's largest cache in bytes (``/sys/devices/system/cpu/cpu0/cache``; :data:`LLC_DEFAULT`
    where it is not readable)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=LLC_DEFAULT)


def cache_evictor(weight_bytes: int = 0) -> Callable[[], None] | None:
    """A function that pushes what the caches hold out of them by writing a buffer of
    :data:`EVICT_FACTOR` times the last-level cache (:func:`last_level_cache_bytes`): a weight timed
    after it is read from memory, as a decode step reads it. None where the weight of
    ``weight_bytes`` is itself that large (it streams from memory at every call anyway)."""
    size = int(last_level_cache_bytes() * EVICT_FACTOR)
    if weight_bytes >= size:
        return None
    buf = torch.empty(size, dtype=torch.uint8)
    state = [0]

    def evict() -> None:
        state[0] = (state[0] + 1) % 251
        buf.fill_(state[0])

    return evict


def choose(
    kernels: list[Kernel], times: dict[str, dict[int, float]], rows: list[int], max_added: float | None = None
) -> list[Pick]:
    """The pick per bucket: the fastest, except that a kernel holding tensors the primary (the one
    fastest at the most buckets; among equals, the least time summed over them) does not hold must
    beat the primary by :data:`MIN_GAIN` in that bucket, and must pay for its memory over the whole
    table (:func:`_pays`), else the primary runs there too. ``max_added``: the most bytes a second
    form may add, as a fraction of the primary's (:data:`MAX_ADDED_QUANTIZED` for a quantized
    weight: its values are held once)."""
    by_name = {kn.name: kn for kn in kernels}
    fastest = {r: min((t[r], name) for name, t in times.items() if r in t)[1] for r in rows}
    wins = {name: sum(f == name for f in fastest.values()) for name in by_name}
    total = {name: sum(times[name].get(r, float("inf")) for r in rows) for name in by_name}
    primary = max(by_name, key=lambda name: (wins[name], -total[name]))  # ties: the least time over all buckets
    held = by_name[primary].storages()
    chosen = {}
    for r in rows:
        best = fastest[r]
        base = times[primary].get(r)
        extra = not by_name[best].storages() <= held
        if extra and base is not None and times[best][r] > (1 - MIN_GAIN) * base:
            best = primary
        chosen[r] = best
    for name in set(chosen.values()) - {primary}:
        used = [r for r in rows if chosen[r] == name]
        if not _pays(by_name[name], by_name[primary], times, used, total[primary], max_added):
            chosen.update({r: primary for r in rows if chosen[r] == name})
    return [Pick(r, chosen[r], times[chosen[r]].get(r, float("nan"))) for r in rows]  # NaN: the primary, pruned there


def _pays(
    form: Kernel, primary: Kernel, times: dict[str, dict[int, float]], used: list[int], base: float, max_added=None
) -> bool:
    """Whether a second ``form`` of a weight, run at the buckets ``used``, saves at least
    :data:`MIN_GAIN` of the primary's time over the whole table (``base``) per copy of the
    primary's bytes it adds: a full second copy must save 10% of the table's time, a bfloat16 copy
    of the scales (a hundredth of the bytes) a thousandth."""
    held = primary.storages()
    added = sum(_nbytes(t) for t in _distinct(form.held) if storage_key(t) not in held)
    if not added:
        return True
    own = sum(_nbytes(t) for t in _distinct(primary.held)) or 1
    if max_added is not None and added > max_added * own:
        return False
    saved = sum(times[primary.name][r] - times[form.name][r] for r in used if r in times[primary.name])
    return saved >= MIN_GAIN * base * added / own


def _distinct(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list({storage_key(t): t for t in tensors}.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tune(
    w: Weight,
    dt: torch.dtype,
    device: torch.device,
    rows: list[int],
    allow_copies: bool = False,
    timer: Callable[[], float] | None = None,
    pool: list[Candidate] | None = None,
    deterministic: bool = False,
) -> tuple[Choice, dict[str, Kernel]]:
    """Check every candidate (``pool``, default :func:`~worker.quant.kernels.candidates`) on ``w``,
    time the eligible ones at ``rows`` and choose. Returns the choice and the eligible kernels built
    for ``w`` (by name). Raises ``RuntimeError`` when no candidate is eligible. ``deterministic``:
    one row-invariant kernel, or at some buckets its declared twin where that gives its values bit
    for bit (:func:`worker.quant.invariance.per_bucket`)."""
    pool = candidates(dt, device) if pool is None else pool
    built = {}
    for cand in pool:
        if cand.copy and not allow_copies:
            continue
        if (kernel := check(cand, w, dt, device)) is not None:
            if cand.invariant:  # declared row-invariant: invariance.row_invariant need not check it
                kernel.row_invariant = True
            kernel.twin = cand.twin
            built[cand.name] = kernel
    n, k = w.shape
    what = weight_label(w, dt)
    if not built:
        raise RuntimeError(f"no kernel can multiply by a {what} weight {n}x{k} on {device.type} here")
    kernels = list(built.values())
    times = measure(kernels, k, rows, dt, device, timer) if len(kernels) > 1 else {kernels[0].name: {}}
    if deterministic:
        names = invariance.per_bucket(built, times, rows, k, dt, device)
        picks = [Pick(r, name, times[name].get(r, float("nan"))) for r, name in zip(rows, names, strict=True)]
    elif len(kernels) == 1:
        picks = [Pick(r, kernels[0].name, float("nan")) for r in rows]
    else:
        one_copy = isinstance(w, QuantizedWeight) and not allow_copies
        picks = choose(kernels, times, rows, MAX_ADDED_QUANTIZED if one_copy else None)
    return Choice(n, k, what, picks, times, list(built), invariant(picks, pool)), built


def invariant(picks: list[Pick], pool: list[Candidate]) -> bool:
    """Whether ``picks`` run one row-count-invariant kernel (:attr:`Candidate.invariant`) at every
    bucket: then a row's values do not depend on how many rows share its step."""
    return len({p.kernel for p in picks}) == 1 and any(c.invariant and c.name == picks[0].kernel for c in pool)


def weight_label(w: Weight, dt: torch.dtype) -> str:
    """``float32``/``bfloat16`` for a float weight (in the compute dtype), else the quantized
    source and its group (``int8/channel``: one group per row; ``Q4_1/g32``)."""
    if isinstance(w, torch.Tensor):
        return str(dt).removeprefix("torch.")
    group = "channel" if w.group_size == w.shape[1] else f"g{w.group_size}"
    return f"{w.source}/{group}"


# ---- one table for the replicas of a model ----------------------------------------------------------


def machine_digest() -> str:
    """16 hex digits naming this machine's timings: the CPU (its model and flags), torch's version,
    the ggml operator's build and the code that times and chooses the kernels (this package's
    sources), which all change them: a table kept across starts is measured again after any of them
    changes."""
    from worker.quant import ggml_kernel

    machine = ggml_kernel.library_path().parent.name + "\0" + ggml_kernel.cpu_flags()
    h = hashlib.sha256(machine.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def table_name(revision: str) -> str:
    """The file name of ``revision``'s kernel table on this machine (:func:`machine_digest`)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in revision)
    return f"kernels-{safe}-{machine_digest()}.json"


@contextlib.contextmanager
def load_or_measure(path: Path | str) -> Iterator[dict[str, list[Pick]]]:
    """The kernel table shared by the replicas of a model, at ``path`` (see :func:`table_name`).

    Holds an exclusive lock (``path`` + ``.lock``) for the block, and yields the table read from
    ``path`` (empty when absent or unreadable): ``{key: [Pick, ...]}``. The block builds the model's
    linears with it (``Linears(..., shared=table)``), which reuse a weight's saved picks and add what
    they measure; on leaving, the table is written back (atomically) when it grew. A replica started
    while another measures waits for it, then reads its table: all run the same kernels."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read_table(path)
        size = len(table)
        yield table
        if len(table) > size:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({key: [asdict(p) for p in picks] for key, picks in table.items()}, indent=1))
            tmp.replace(path)


def _read_table(path: Path) -> dict[str, list[Pick]]:
    try:
        raw = json.loads(path.read_text())
        return {key: [Pick(**p) for p in picks] for key, picks in raw.items()}
    except (OSError, ValueError, TypeError) as exc:
        if path.exists():
            log.warning("kernel table %s unreadable (%s): measuring again", path, exc)
        return {}
