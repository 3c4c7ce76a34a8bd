"""The deployment plan: which worker goes where, what it can hold, and what to change when it does not fit.

The arithmetic is :mod:`launcher.plan.sizing`; the layouts compared are :mod:`launcher.plan.layouts`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from launcher.config import DeployConfig
from launcher.plan.context import AUTO, fitted_length, native_context, with_length
from launcher.plan.embed import (
    EmbedFit,
    EmbedSizing,
    describe,
    embed_problems,
    embed_replicas,
    fit_embed,
    size_embed,
)
from launcher.plan.layouts import LAYER_SPLIT, TENSOR_PARALLEL, choose, compare, tp_unavailable
from launcher.plan.placement import GpuInfo, Inventory, PlacementError, WorkerSpec, place, visible_gpus
from launcher.plan.sizing import (
    CPU_PROCESS_BYTES,
    GPU_CONTEXT_BYTES,
    QUANTIZATIONS,
    Sizing,
    gpu_budget,
    planned_facts,
    resize,
    size,
    slot_budget,
    tp_rank_activations,
    tp_rank_weights,
)
from worker.contract import dtypes
from worker.contract.budget import kv_budget
from worker.contract.shapes import ModelShape, weight_format
from worker.contract.units import GB, GiB

log = logging.getLogger(__name__)

MAX_RECOMMENDED_SEQS = 256  # beyond this a batch is compute-bound; more sequences only add latency
BUSY_FRACTION = 0.10  # a GPU with more than this share in use by others is reported


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
        budget = sum(slot_budget(f, util, spec.share) for f in facts)
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
    embed: bool = False  # an embedding model: no max_num_seqs to recommend (it keeps no KV cache)

    def describe(self) -> str:
        if self.replicas == 0:
            return self.note
        gpus = f"gpus_per_replica: {self.gpus_per_replica}, " if self.device == "cuda" else "devices: cpu, "
        if self.tensor_parallel_size > 1:
            gpus = f"tensor_parallel_size: {self.tensor_parallel_size}, "
        seqs = "" if self.embed else f", max_num_seqs: {self.max_num_seqs}"
        return f"replicas: {self.replicas}, {gpus.removesuffix(', ')}{seqs}" + (f" ({self.note})" if self.note else "")


def recommend(sizing: Sizing, gpus: list[GpuInfo], cfg: DeployConfig) -> Recommendation:
    """Data parallel when one replica fits a GPU, else tensor parallel over the fewest GPUs that
    hold it and divide the model, else a layer split (:func:`launcher.plan.layouts.choose`);
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
    util = cfg.workers.gpu_memory_utilization
    chosen = choose(compare(sizing, gpus, util, tp_unavailable(cfg)))
    if chosen is None:
        return Recommendation("cuda", 0, 0, 0, _no_fit_note(sizing, gpus, util, tp_unavailable(cfg)))
    seqs, n = min(chosen.seqs, MAX_RECOMMENDED_SEQS), chosen.gpus_per_replica
    if chosen.kind == TENSOR_PARALLEL:
        return Recommendation("cuda", chosen.replicas, 1, seqs, tensor_parallel_size=n)
    no_tp = tp_unavailable(cfg)
    why_split = (
        f"tensor parallel is {no_tp}" if no_tp else "tensor_parallel_size cannot divide the model over these GPUs"
    )
    note = f"layer split: {why_split}" if chosen.kind == LAYER_SPLIT else ""
    return Recommendation("cuda", chosen.replicas, n, seqs, note)


def _no_fit_note(sizing: Sizing, gpus: list[GpuInfo], utilization: float, no_tp: str = "") -> str:
    """Why nothing fits, and the lightest change that does: quantizing the linear layers
    (``model.quantization``, the first of int8 and int4 lighter than the planned format whose
    layout fits) or a smaller ``max_model_len``."""
    n = len(gpus)
    budget = sum(gpu_budget(g, utilization) for g in gpus)
    note = (
        f"{sizing.label} needs {sizing.need(n) / GiB:.1f} GiB split over all {n} GPU(s), which give "
        f"{budget / GiB:.1f} GiB"
    )
    for quantization in QUANTIZATIONS[1:]:
        lighter = resize(sizing, sizing.dtype, weight_format(quantization, None))
        if lighter.weights >= sizing.weights:
            continue
        if (chosen := choose(compare(lighter, gpus, utilization, no_tp))) is not None:
            per = "" if chosen.gpus_per_replica == 1 else f" (over {chosen.gpus_per_replica} GPUs)"
            return (
                f"{note}: does not fit in {sizing.label}; fits with model.quantization: {quantization} — "
                f"{chosen.kv_room // lighter.kv_per_token:,} tokens of KV cache per replica{per} "
                f"({lighter.weights / GiB:.1f} GiB weights; {chosen.setting}, replicas: {chosen.replicas})"
            )
    return note + "; use more or larger GPUs, or a smaller model.max_model_len"


@dataclass
class ModelPlan:
    """One model's deployment plan (what ``llamadeploy plan`` shows for it): sizing, placed workers
    and how each fits, the problems (``errors`` stop ``up``), and a recommendation for this
    hardware; a deployment of several models has one each (:class:`~launcher.plan.several.MultiModelPlan`). An embedding model's
    (:mod:`launcher.plan.embed`) has an :class:`EmbedSizing` and :class:`EmbedFit` s."""

    sizing: Sizing | EmbedSizing
    gpus: list[GpuInfo]
    specs: list[WorkerSpec]
    fits: list[WorkerFit] | list[EmbedFit]
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
    """``override`` or ``model.dtype``; ``auto`` is :func:`worker.contract.dtypes.resolve`'s choice, as the
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
) -> ModelPlan:
    """Place (unless ``specs`` are given), size and check the deployment ``cfg`` on ``inv``, with
    ``dtype`` overriding ``model.dtype``; the weights as ``model.quantization`` holds them.

    A placement error, a worker whose budget cannot hold weights + overhead + one full-length
    sequence, or CPU workers needing more RAM than is available are ``errors``; stored GGUF types
    ``auto`` cannot serve are a warning (the worker's load refuses them).
    """
    if cfg.model.max_model_len == AUTO:
        return _auto_plan(cfg, inv, shape, dtype, specs)
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
    if shape.embed is not None:
        return _embed_plan(cfg, shape, chosen, gpus if on_gpu else [], specs, errors, inv)
    fmt = weight_format(cfg.model.quantization, shape.gguf_types)
    sizing = size(
        shape,
        chosen,
        cfg.model.max_model_len,
        w.max_num_seqs,
        max(w.prefill_budgets(on_gpu)),  # the largest step
        fmt,
    )
    rec = recommend(sizing, gpus if on_gpu else [], cfg)
    fits = [fit_worker(s, sizing, cfg) for s in specs]
    if w.tensor_parallel_size > 1:
        from worker.contract.tp_rules import tp_problems

        errors.extend(tp_problems(shape, w.tensor_parallel_size, cfg.model.quantization))
    plan = ModelPlan(sizing, gpus, specs, fits, rec, errors, [fmt.problem] if fmt.problem else [])
    _check(plan, cfg, inv)
    return plan


def _auto_plan(
    cfg: DeployConfig, inv: Inventory, shape: ModelShape, dtype: str | None, specs: list[WorkerSpec] | None
) -> ModelPlan:
    """:func:`make_plan` of ``model.max_model_len: auto`` (:mod:`launcher.plan.context`): planned at
    the model's own length, and again at the reduced one when a worker's KV budget holds less."""
    native = native_context(shape)
    trial = make_plan(with_length(cfg, native, 0), inv, shape, dtype, specs)
    if isinstance(trial.sizing, EmbedSizing):
        return trial
    held = min((f.kv_room // trial.sizing.kv_per_token for f in trial.fits), default=native)
    length = fitted_length(native, held, shape.name)
    return trial if length == native else make_plan(with_length(cfg, length, 0), inv, shape, dtype, specs)


def _embed_plan(
    cfg: DeployConfig,
    shape: ModelShape,
    dtype: str,
    gpus: list[GpuInfo],
    specs: list[WorkerSpec],
    errors: list[str],
    inv: Inventory,
) -> ModelPlan:
    """:func:`make_plan` of an embedding model: weights + one step's activations, no KV cache."""
    w = cfg.workers
    sizing = size_embed(shape, dtype, w.max_prefill_tokens, bool(gpus))
    fits = [fit_embed(s, sizing, w.gpu_memory_utilization) for s in specs]
    if not gpus:
        rec = Recommendation("cpu", 1, 0, 0, embed=True)
    elif replicas := embed_replicas(sizing, gpus, w.gpu_memory_utilization):
        rec = Recommendation("cuda", replicas, 1, 0, embed=True)
    else:
        note = (
            f"{shape.name} needs {sizing.need(True) / GiB:.2f} GiB on one GPU, more than any of these gives "
            "(gpu_memory_utilization × total − used); lower workers.max_prefill_tokens or use a larger GPU"
        )
        rec = Recommendation("cuda", 0, 0, 0, note, embed=True)
    errors = [*errors, *embed_problems(fits, sizing, w.tensor_parallel_size)]
    plan = ModelPlan(sizing, gpus, specs, fits, rec, errors)
    _check_memory(plan, inv)
    return plan


def _check(plan: ModelPlan, cfg: DeployConfig, inv: Inventory) -> None:
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
            f"{s.weights / GiB:.2f} GiB weights ({s.label}) + {overhead / GiB:.2f} GiB overhead + "
            f"{s.kv_per_seq / GiB:.2f} GiB KV for one {s.max_model_len}-token sequence = "
            f"{(s.weights + overhead + s.kv_per_seq) / GiB:.2f} GiB; {fix}"
        )
    _check_memory(plan, inv)


def _check_memory(plan: ModelPlan, inv: Inventory) -> None:
    """An error when the CPU workers together need more RAM than is available; a warning per GPU
    used that other processes already fill."""
    used = {g.index: g for f in plan.fits for g in f.spec.gpu_info}
    for g in used.values():
        if g.used_bytes > BUSY_FRACTION * g.total_bytes:
            plan.warnings.append(
                f"GPU {g.index} ({g.name}): {g.used_bytes / GiB:.1f} GiB of {g.total_bytes / GiB:.1f} "
                "GiB already in use by other processes; the budget above excludes it"
            )
    if (error := ram_error(plan.fits, inv.ram_available_bytes)) is not None:
        plan.errors.append(error)


def ram_error(fits: list[WorkerFit | EmbedFit], available: int | None, each: str = "") -> str | None:
    """The error when the CPU workers among ``fits`` need more RAM together than ``available``
    (bytes; None: unknown, no check), else None. It says what each kind of worker counts and the
    keys that lower it: a chat worker's KV cache (``kv_cache_gib``), an embedding worker's step
    (``max_prefill_tokens``; it keeps no KV cache). ``each``: the need per model (several models)."""
    cpu = [f for f in fits if f.spec.device == "cpu"]
    need = sum(f.budget for f in cpu)
    if not need or not available or need <= available:
        return None
    counted, keys = [], ["replicas"]
    if any(not isinstance(f, EmbedFit) for f in cpu):
        counted.append("weights + overhead + kv_cache_gib per chat worker")
        keys.append("workers.kv_cache_gib")
    if any(isinstance(f, EmbedFit) for f in cpu):
        counted.append("weights + overhead + one step's activations per embedding worker, which keeps no KV cache")
        keys.append("workers.max_prefill_tokens (an embedding worker's step)")
    return (
        f"CPU workers need {need / GiB:.2f} GiB of RAM{' together' if each else ''} "
        f"({each + '; ' if each else ''}{'; '.join(counted)}) but {available / GiB:.2f} GiB is available; "
        f"lower {', '.join(keys[:-1])} or {keys[-1]}"
    )


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
    from launcher.plan.shape import read_shapes

    shapes = read_shapes([cfg.model])
    if shapes is None:
        return None
    plan = make_plan(cfg, inv, shapes[0], specs=specs)
    for warning in plan.warnings:
        log.warning("plan: %s", warning)
    if plan.ok:
        log.info("plan: %s; %s", shapes[0].name, summary(plan))
        return None
    return "the deployment does not fit (`llamadeploy plan` shows the arithmetic):\n  " + "\n  ".join(plan.errors)


def summary(plan: ModelPlan) -> str:
    """One line of what a fitting plan holds (``up``'s log)."""
    s = plan.sizing
    if isinstance(s, EmbedSizing):
        return f"{describe(s)}, every worker fits"
    fits = ", ".join(f"worker {f.spec.worker_id} fits {f.seqs} full-length seqs" for f in plan.fits)
    return f"{s.label} weights {s.weights / GiB:.2f} GiB, KV {s.kv_per_token / 1024:.0f} KiB/token; {fits}"
