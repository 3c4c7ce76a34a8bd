"""Memory planning: weights + KV cache + overhead against each GPU, before anything is loaded.

The arithmetic (the article's §2; the same terms vLLM's and TGI's memory profilers use):

* weights = parameters × bytes per parameter (4 float32, 2 bfloat16/float16, 1 int8, 0.5 int4);
  the parameter count comes from the config (:attr:`ModelShape.params`);
* KV cache per token = 2 (K and V) × layers × kv_heads × head_dim × element bytes (2, or 4 in
  float32; int8/int4 weights still keep a 16-bit cache); the deployment wants it for
  ``max_num_seqs × max_model_len`` tokens, and at the very least for one ``max_model_len`` sequence;
* overhead = per GPU, an allowance for the CUDA context, workspaces and fragmentation
  (:data:`worker.budget.GPU_ALLOWANCE_BYTES`, 1 GiB) + one prefill chunk's activations
  (``max_prefill_tokens × (2 × intermediate + 4 × hidden)`` elements) + the last-position float32
  logits of a full batch; on CPU 0.75 GiB of process memory + the same activations.

A GPU worker's KV room is :func:`worker.budget.kv_budget`, the rule the worker itself applies
after warm-up (with measured weights and activation peak where this module estimates them): the
smaller of ``total × gpu_memory_utilization × share − weights − activations − allowance`` and
what free memory allows once other processes are counted, per GPU, the tightest GPU of a layer
split bounding the tokens. GB means 1e9 bytes, GiB 2^30.

A tensor-parallel rank (``tensor_parallel_size: N``) holds 1/N of every attention and MLP
matrix plus the replicated embeddings, norms and LM head (:mod:`worker.tp_rules`), 1/N of the KV
heads (so 1/N of a token's KV bytes), and a prefill step's activations with the MLP's channels
split N ways.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from launcher import shapes
from launcher.config import DeployConfig
from launcher.placement import GpuInfo, Inventory, PlacementError, WorkerSpec, place, visible_gpus
from launcher.shapes import ModelShape
from worker import dtypes
from worker.budget import GPU_ALLOWANCE_BYTES, GpuFacts, KvBudget, kv_budget, reserve

log = logging.getLogger(__name__)

GB = 10**9
GiB = 2**30
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}
SERVABLE_DTYPES = ("float32", "bfloat16", "float16")
GPU_CONTEXT_BYTES = GPU_ALLOWANCE_BYTES
CPU_PROCESS_BYTES = 3 * GiB // 4
MAX_RECOMMENDED_SEQS = 256  # beyond this a batch is compute-bound; more sequences only add latency
BUSY_FRACTION = 0.10  # a GPU with more than this share in use by others is reported


def weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of the weights at ``dtype`` (one of :data:`DTYPE_BYTES`); quantized formats' scales
    (a few percent) are not counted."""
    return int(shape.params * DTYPE_BYTES[dtype])


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """:func:`launcher.shapes.kv_bytes_per_token` of ``shape`` with weights at ``dtype``: the cache
    is float32 for float32 weights, else 16-bit (int8/int4 weights still keep a 16-bit cache)."""
    element = 4 if dtype == "float32" else 2
    return shapes.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, element)


@dataclass(frozen=True)
class Sizing:
    """Device-independent arithmetic for one model, dtype and set of limits (bytes)."""

    shape: ModelShape
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_prefill_tokens: int
    weights: int
    kv_per_token: int
    activations: int

    @property
    def kv_per_seq(self) -> int:
        return self.kv_per_token * self.max_model_len

    @property
    def kv_full(self) -> int:
        return self.kv_per_seq * self.max_num_seqs

    def overhead(self, gpus: int) -> int:
        """Allowance plus activations on each of ``gpus`` GPUs (0 = CPU: process memory plus
        activations). A layer split peaks on every GPU in turn, so each carries both."""
        return (GPU_CONTEXT_BYTES + self.activations) * gpus if gpus else CPU_PROCESS_BYTES + self.activations

    def need(self, gpus: int, seqs: int = 1) -> int:
        """Bytes one replica on ``gpus`` GPUs needs to hold ``seqs`` full-length sequences."""
        return self.weights + self.overhead(gpus) + seqs * self.kv_per_seq


def activation_bytes(
    shape: ModelShape, dtype: str, max_model_len: int, max_num_seqs: int, max_prefill_tokens: int, tp: int = 1
) -> int:
    """One prefill step's activation peak on one GPU: ``min(max_prefill_tokens, S × L) × (2 ×
    intermediate / tp + 4 × hidden)`` elements, plus a full batch's float32 last-position logits."""
    act_bytes = 4 if dtype == "float32" else 2
    prefill = min(max_prefill_tokens, max_model_len * max_num_seqs)
    activations = prefill * (2 * shape.intermediate_size // tp + 4 * shape.hidden_size) * act_bytes
    return activations + max_num_seqs * shape.vocab_size * 4


def replicated_params(shape: ModelShape) -> int:
    """Parameters every tensor-parallel rank holds whole: embeddings, LM head (unless tied), norms."""
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return embeddings + shape.hidden_size * (2 * shape.num_layers + 1)


def tp_rank_weights(sizing: Sizing, tp: int) -> int:
    """Bytes of one rank's weights in a ``tp``-way tensor-parallel replica."""
    replicated = replicated_params(sizing.shape)
    return int(((sizing.shape.params - replicated) / tp + replicated) * DTYPE_BYTES[sizing.dtype])


def tp_rank_activations(sizing: Sizing, tp: int) -> int:
    """One rank's activation peak (:func:`activation_bytes` with the MLP split ``tp`` ways)."""
    s = sizing
    return activation_bytes(s.shape, s.dtype, s.max_model_len, s.max_num_seqs, s.max_prefill_tokens, tp)


def size(shape: ModelShape, dtype: str, max_model_len: int, max_num_seqs: int, max_prefill_tokens: int) -> Sizing:
    """Compute the :class:`Sizing` for ``dtype`` (a key of :data:`DTYPE_BYTES`)."""
    return Sizing(
        shape,
        dtype,
        max_model_len,
        max_num_seqs,
        max_prefill_tokens,
        weight_bytes(shape, dtype),
        kv_bytes_per_token(shape, dtype),
        activation_bytes(shape, dtype, max_model_len, max_num_seqs, max_prefill_tokens),
    )


def resize(sizing: Sizing, dtype: str) -> Sizing:
    """The same model and limits at another ``dtype``."""
    return size(sizing.shape, dtype, sizing.max_model_len, sizing.max_num_seqs, sizing.max_prefill_tokens)


def gpu_budget(gpu: GpuInfo, utilization: float) -> int:
    """Bytes a worker may use on an idle-for-us ``gpu``: ``utilization × total − used`` (0 at least)."""
    return max(0, int(gpu.total_bytes * utilization) - gpu.used_bytes)


def planned_facts(
    gpus: tuple[GpuInfo, ...] | list[GpuInfo], sizing: Sizing, utilization: float, share: float = 1.0, tp: int = 1
) -> list[GpuFacts]:
    """The facts :func:`worker.budget.kv_budget` needs, as planned before loading: NVML's free
    memory, the weights and layers split evenly over the GPUs (with ``tp`` > 1: one
    tensor-parallel rank's weights and 1/tp of the KV heads on each), the activation estimate on each.

    Co-tenant replicas (``share < 1``) are assumed to hold their whole share already, so the
    figure is what the last of them to start gets.
    """
    k = len(gpus)
    co_tenants = round(1 / share) - 1
    if tp > 1:
        weights, activations = tp_rank_weights(sizing, tp), tp_rank_activations(sizing, tp)
    else:
        weights, activations = sizing.weights // k, sizing.activations
    return [
        GpuFacts(
            g.total_bytes,
            g.free_bytes - co_tenants * int(g.total_bytes * utilization * share),
            weights,
            activations,
            1 / k,
        )
        for g in gpus
    ]


def planned_budget(
    gpus: tuple[GpuInfo, ...] | list[GpuInfo], sizing: Sizing, utilization: float, share: float = 1.0, tp: int = 1
) -> KvBudget:
    """:func:`worker.budget.kv_budget` over :func:`planned_facts`."""
    return kv_budget(planned_facts(gpus, sizing, utilization, share, tp), sizing.kv_per_token, utilization, share)


def min_gpus(sizing: Sizing, gpus: list[GpuInfo], utilization: float) -> int | None:
    """Fewest GPUs (the first ``k`` of ``gpus``) whose KV budget holds one full-length sequence;
    ``None`` if even all of them do not."""
    return next(
        (
            k
            for k in range(1, len(gpus) + 1)
            if planned_budget(gpus[:k], sizing, utilization).tokens >= sizing.max_model_len
        ),
        None,
    )


@dataclass(frozen=True)
class WorkerFit:
    """How one placed worker fares: ``budget`` it may use, ``kv_room`` left for the KV cache,
    ``seqs`` full-length sequences that fit in it."""

    spec: WorkerSpec
    budget: int
    overhead: int
    kv_room: int
    seqs: int

    @property
    def fits(self) -> bool:
        return self.seqs >= 1


def fit_worker(spec: WorkerSpec, sizing: Sizing, cfg: DeployConfig) -> WorkerFit:
    """GPU: budget = Σ over its GPUs of ``min(utilization × share × total, free − (1 −
    utilization) × total)``; KV room from :func:`planned_budget` (the worker's rule). CPU: the KV
    room is ``kv_cache_gib``, per rank of a tensor-parallel slot (RAM is checked across workers by
    :func:`make_plan`)."""
    if spec.device == "cuda":
        util = cfg.workers.gpu_memory_utilization
        facts = planned_facts(spec.gpu_info, sizing, util, spec.share, spec.tp)
        budget = sum(
            max(0, min(int(f.total_bytes * util * spec.share), f.free_bytes - reserve(f.total_bytes, util)))
            for f in facts
        )
        kv = kv_budget(facts, sizing.kv_per_token, util, spec.share)
        overhead = sum(GPU_CONTEXT_BYTES + f.activation_peak_bytes for f in facts)
        room = kv.tokens * sizing.kv_per_token
        return WorkerFit(spec, budget, overhead, room, kv.tokens // sizing.max_model_len)
    room = int(cfg.workers.kv_cache_gib * GiB)
    if spec.tp > 1:  # each rank is a process with its part of the weights and its own activations
        weights = tp_rank_weights(sizing, spec.tp) * spec.tp
        overhead = (CPU_PROCESS_BYTES + tp_rank_activations(sizing, spec.tp)) * spec.tp
        room *= spec.tp  # kv_cache_gib per rank, each for its 1/tp of the KV heads (worker.replica.load_shard)
    else:
        weights, overhead = sizing.weights, sizing.overhead(0)
    return WorkerFit(spec, weights + overhead + room, overhead, room, room // sizing.kv_per_seq)


@dataclass(frozen=True)
class Recommendation:
    """What to configure on these GPUs (or CPU); ``note`` explains when nothing fits.
    ``tensor_parallel_size`` > 1 means replicas of that many ranks (``gpus_per_replica`` is then 1)."""

    device: str
    replicas: int
    gpus_per_replica: int
    max_num_seqs: int
    note: str = ""
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        if self.replicas == 0:
            return self.note
        gpus = f"gpus_per_replica: {self.gpus_per_replica}, " if self.device == "cuda" else "devices: cpu, "
        if self.tensor_parallel_size > 1:
            gpus = f"tensor_parallel_size: {self.tensor_parallel_size}, "
        return f"replicas: {self.replicas}, {gpus}max_num_seqs: {self.max_num_seqs}" + (
            f" ({self.note})" if self.note else ""
        )


def recommend(sizing: Sizing, gpus: list[GpuInfo], cfg: DeployConfig) -> Recommendation:
    """Data parallel when one replica fits a GPU, else tensor parallel over the fewest GPUs that
    hold it and divide the model, else a layer split (:func:`launcher.layouts.choose`);
    ``max_num_seqs`` = full-length sequences that fit the KV room (at most 256)."""
    if not gpus:
        seqs = int(cfg.workers.kv_cache_gib * GiB) // sizing.kv_per_seq
        if seqs < 1:
            return Recommendation(
                "cpu",
                0,
                0,
                0,
                f"raise workers.kv_cache_gib to at least {sizing.kv_per_seq / GiB:.2f} or lower model.max_model_len",
            )
        return Recommendation("cpu", 1, 0, min(seqs, MAX_RECOMMENDED_SEQS))
    from launcher.layouts import LAYER_SPLIT, TENSOR_PARALLEL, choose, compare, tp_unavailable

    util = cfg.workers.gpu_memory_utilization
    chosen = choose(compare(sizing, gpus, util, tp_unavailable(cfg)))
    if chosen is None:
        return Recommendation("cuda", 0, 0, 0, _no_fit_note(sizing, gpus, util))
    seqs, n = min(chosen.seqs, MAX_RECOMMENDED_SEQS), chosen.gpus_per_replica
    if chosen.kind == TENSOR_PARALLEL:
        return Recommendation("cuda", chosen.replicas, 1, seqs, tensor_parallel_size=n)
    no_tp = tp_unavailable(cfg)
    why_split = (
        f"tensor parallel is {no_tp}" if no_tp else "tensor_parallel_size cannot divide the model over these GPUs"
    )
    note = f"layer split: {why_split}" if chosen.kind == LAYER_SPLIT else ""
    return Recommendation("cuda", chosen.replicas, n, seqs, note)


def _no_fit_note(sizing: Sizing, gpus: list[GpuInfo], utilization: float) -> str:
    n = len(gpus)
    budget = sum(gpu_budget(g, utilization) for g in gpus)
    note = (
        f"{sizing.dtype} needs {sizing.need(n) / GiB:.1f} GiB split over all {n} GPU(s), which give "
        f"{budget / GiB:.1f} GiB; use more or larger GPUs"
    )
    for dtype in ("int8", "int4"):
        if DTYPE_BYTES[dtype] < DTYPE_BYTES[sizing.dtype]:
            lighter = resize(sizing, dtype)
            if (k := min_gpus(lighter, gpus, utilization)) is not None:
                return (
                    note + f", or an {dtype}-quantized model ({k} GPU(s); served by another engine, "
                    "llamadeploy loads float weights)"
                )
    return note + ", or a smaller model.max_model_len"


@dataclass
class Plan:
    """The plan for one deployment: sizing, placed workers and how each fits, the problems
    (``errors`` stop ``up``), and a recommendation for this hardware."""

    sizing: Sizing
    gpus: list[GpuInfo]
    specs: list[WorkerSpec]
    fits: list[WorkerFit]
    recommendation: Recommendation
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def plan_dtype(
    cfg: DeployConfig,
    on_gpu: bool,
    override: str | None = None,
    gpus: list[GpuInfo] | tuple[GpuInfo, ...] = (),
    cpu_flags: frozenset[str] = frozenset(),
) -> str:
    """``override`` or ``model.dtype``; ``auto`` is :func:`worker.dtypes.resolve`'s choice, as the
    worker makes it: bfloat16 on GPUs of compute capability ≥ 8.0 (or unknown), float16 below;
    on CPU bfloat16 with avx512_bf16/AMX in ``cpu_flags``, else float32."""
    dtype = override or cfg.model.dtype
    if dtype != "auto":
        return dtype
    capabilities = [g.capability for g in gpus if g.capability]
    return dtypes.resolve("auto", "cuda" if on_gpu else "cpu", capabilities, cpu_flags)


def make_plan(
    cfg: DeployConfig,
    inv: Inventory,
    shape: ModelShape,
    dtype: str | None = None,
    specs: list[WorkerSpec] | None = None,
) -> Plan:
    """Place (unless ``specs`` are given), size and check the deployment ``cfg`` on ``inv``.

    A placement error, a worker whose budget cannot hold weights + overhead + one full-length
    sequence, or CPU workers needing more RAM than is available are ``errors``.
    """
    errors: list[str] = []
    gpus: list[GpuInfo] = []
    try:
        gpus = visible_gpus(inv)  # first: a layout the GPUs cannot take is still planned for them
        specs = specs if specs is not None else place(cfg.workers, inv)
    except PlacementError as exc:
        errors.append(f"workers: {exc}")
        specs = []
    on_gpu = any(s.device == "cuda" for s in specs) if specs else bool(gpus) and cfg.workers.devices != "cpu"
    w = cfg.workers
    placed = [g for spec in specs for g in spec.gpu_info] or gpus
    chosen = plan_dtype(cfg, on_gpu, dtype, placed, inv.cpu_flags)
    sizing = size(
        shape, chosen, cfg.model.max_model_len, w.max_num_seqs, max(w.prefill_budgets(on_gpu))
    )  # the largest step
    rec = recommend(sizing, gpus if on_gpu else [], cfg)
    fits = [fit_worker(s, sizing, cfg) for s in specs]
    if w.tensor_parallel_size > 1:
        from worker.tp_rules import tp_problems

        errors.extend(tp_problems(shape, w.tensor_parallel_size, cfg.model.quantization))
    plan = Plan(sizing, gpus, specs, fits, rec, errors)
    _check(plan, cfg, inv)
    return plan


def _check(plan: Plan, cfg: DeployConfig, inv: Inventory) -> None:
    s = plan.sizing
    rec = plan.recommendation
    fix = f"fix: set workers {rec.describe()}" if rec.replicas else f"fix: {rec.note}"
    groups: dict[tuple[int, int], list[WorkerFit]] = {}
    for f in plan.fits:
        if not f.fits:
            groups.setdefault((f.budget, f.overhead), []).append(f)
        elif f.seqs < s.max_num_seqs:
            plan.warnings.append(
                f"worker {f.spec.worker_id}: KV room {f.kv_room / GiB:.2f} GiB holds {f.seqs} sequence(s) of "
                f"{s.max_model_len} tokens, fewer than max_num_seqs={s.max_num_seqs}; the rest wait when "
                f"prompts are long (max_num_seqs: {f.seqs} or a smaller max_model_len make it exact)"
            )
    for (budget, overhead), fits in groups.items():
        many = len(fits) > 1
        who = ("workers " if many else "worker ") + ", ".join(f"{f.spec.worker_id} ({f.spec.label})" for f in fits)
        plan.errors.append(
            f"{who} may use {budget / GiB:.2f} GiB{' each' if many else ''} but need{'' if many else 's'} "
            f"{s.weights / GiB:.2f} GiB weights ({s.dtype}) + {overhead / GiB:.2f} GiB overhead + "
            f"{s.kv_per_seq / GiB:.2f} GiB KV for one {s.max_model_len}-token sequence = "
            f"{(s.weights + overhead + s.kv_per_seq) / GiB:.2f} GiB; {fix}"
        )
    cpu_need = sum(f.budget for f in plan.fits if f.spec.device == "cpu")
    if cpu_need and inv.ram_available_bytes and cpu_need > inv.ram_available_bytes:
        plan.errors.append(
            f"CPU workers need {cpu_need / GiB:.2f} GiB of RAM (weights + overhead + kv_cache_gib "
            f"each) but {inv.ram_available_bytes / GiB:.2f} GiB is available; lower replicas or "
            "workers.kv_cache_gib"
        )
    used = {g.index: g for f in plan.fits for g in f.spec.gpu_info}
    for g in used.values():
        if g.used_bytes > BUSY_FRACTION * g.total_bytes:
            plan.warnings.append(
                f"GPU {g.index} ({g.name}): {g.used_bytes / GiB:.1f} GiB of {g.total_bytes / GiB:.1f} "
                "GiB already in use by other processes; the budget above excludes it"
            )
    if s.dtype not in SERVABLE_DTYPES:
        plan.warnings.append(f"{s.dtype} is for sizing only: llamadeploy serves float32, bfloat16 or float16 weights")


def parse_gpus(text: str) -> list[GpuInfo]:
    """``"8x80GB"``, ``"2x24GiB,1x48GiB"`` or ``"80GB,80GB"`` → idle hypothetical GPUs.

    GB = 1e9 bytes, GiB = 2^30. Raises ``ValueError`` naming the bad part.
    """
    gpus: list[GpuInfo] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"(?:(\d+)\s*[x×*]\s*)?(\d+(?:\.\d+)?)\s*(GB|GiB)", part, re.IGNORECASE)
        if not m:
            raise ValueError(f"--gpus: {part!r} is not like 80GB, 24GiB or 4x80GB")
        unit = GiB if m.group(3).lower() == "gib" else GB
        total = int(float(m.group(2)) * unit)
        for _ in range(int(m.group(1) or 1)):
            gpus.append(GpuInfo(len(gpus), "(given)", f"GPU-given-{len(gpus)}", total, total))
    if not gpus:
        raise ValueError("--gpus: empty; give sizes like 4x80GB")
    return gpus


def preflight(cfg: DeployConfig, inv: Inventory, specs: list[WorkerSpec]) -> str | None:
    """The check ``llamadeploy up`` runs before loading: ``None`` when the deployment fits (or its
    config cannot be read here: resolving the model reports that), else the errors and a fix."""
    from launcher.models import ModelNotFound
    from launcher.shapes import ShapeError, read_shape

    try:
        shape = read_shape(cfg.model.name)
    except (ModelNotFound, ShapeError) as exc:
        log.warning("memory plan skipped: %s", exc)
        return None
    plan = make_plan(cfg, inv, shape, specs=specs)
    for warning in plan.warnings:
        log.warning("plan: %s", warning)
    if plan.ok:
        s = plan.sizing
        log.info(
            "plan: %s %s weights %.2f GiB, KV %.0f KiB/token; %s",
            shape.name,
            s.dtype,
            s.weights / GiB,
            s.kv_per_token / 1024,
            ", ".join(f"worker {f.spec.worker_id} fits {f.seqs} full-length seqs" for f in plan.fits),
        )
        return None
    return "the deployment does not fit (`llamadeploy plan` shows the arithmetic):\n  " + "\n  ".join(plan.errors)
