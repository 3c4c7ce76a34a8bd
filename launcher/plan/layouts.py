"""Data parallel, tensor parallel or a layer split: how one replica of a model can use the GPUs.

The rule, as vLLM's users apply ``--tensor-parallel-size``: when a replica fits
one GPU, run one replica per GPU (data parallel: no communication, throughput scales with the
GPUs). When it does not, split every layer over the fewest GPUs that hold it (tensor parallel:
all of them work on every token, so a request is faster than on one card; the heads, KV heads
and MLP width must divide by N, :mod:`worker.contract.tp_rules`). Split the model by layers (a pipeline in
which one GPU works at a time: it fits, never faster than one card) only where tensor parallelism
cannot divide the model over the GPUs at hand.

Once a replica has to be split, the tensor-parallel size chosen is the smallest that holds a
full batch (``max_num_seqs`` full-length sequences) in its KV room, else the smallest that holds
one sequence: Llama-2-70B in 16-bit on 80 GB cards fits two of them with room for a single
sequence, and four with room for hundreds.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import DeployConfig
from launcher.plan.placement import GpuInfo
from launcher.plan.sizing import Sizing, gpu_budget, min_gpus, planned_budget, tp_rank_weights
from worker.contract.units import GiB

DATA_PARALLEL, TENSOR_PARALLEL, LAYER_SPLIT = "data parallel", "tensor parallel", "layer split"


@dataclass(frozen=True)
class Layout:
    """One way to run replicas on the GPUs: ``gpus_per_replica`` (0 when none works), how many
    ``replicas`` the GPUs give, each replica's ``kv_room`` (bytes, over all its GPUs) and the
    full-length ``seqs`` it holds; ``why_not`` says why it does not fit ("" when it does)."""

    kind: str
    gpus_per_replica: int
    replicas: int
    kv_room: int
    seqs: int
    why_not: str = ""

    @property
    def fits(self) -> bool:
        return self.seqs >= 1 and not self.why_not

    @property
    def setting(self) -> str:
        """The deploy.yaml keys of this layout."""
        if self.kind == TENSOR_PARALLEL:
            return f"tensor_parallel_size: {self.gpus_per_replica}"
        if self.kind == LAYER_SPLIT:
            return f"gpus_per_replica: {self.gpus_per_replica}"
        return "gpus_per_replica: 1"


def _layout(kind: str, sizing: Sizing, gpus: list[GpuInfo], n: int, utilization: float, tp: int = 1) -> Layout:
    tokens = planned_budget(gpus[:n], sizing, utilization, tp=tp).tokens
    seqs = tokens // sizing.max_model_len
    why = ""
    if not seqs:
        weights = tp_rank_weights(sizing, tp) if tp > 1 else sizing.weights // n
        why = f"{weights / GiB:.1f} GiB weights/GPU + overhead: no room for one {sizing.max_model_len}-token sequence"
    return Layout(kind, n, len(gpus) // n, tokens * sizing.kv_per_token, seqs, why)


def data_parallel(sizing: Sizing, gpus: list[GpuInfo], utilization: float) -> Layout:
    """One replica per GPU."""
    return _layout(DATA_PARALLEL, sizing, gpus, 1, utilization)


def tp_unavailable(cfg: DeployConfig) -> str:
    """Why this deployment cannot use tensor parallelism whatever the GPUs ("" when it can)."""
    if cfg.cluster.backend == "ray":
        return "local only: not with cluster.backend: ray (a replica stays on one node, one process)"
    return ""


def tensor_parallel(sizing: Sizing, gpus: list[GpuInfo], utilization: float, unavailable: str = "") -> Layout:
    """The tensor-parallel size to use on ``gpus`` (see the module doc), or why there is none
    (``unavailable``: a reason from the deployment, :func:`tp_unavailable`)."""
    from worker.contract.tp_rules import valid_sizes

    if unavailable:
        return Layout(TENSOR_PARALLEL, 0, 0, 0, 0, unavailable)
    if any(g.is_mig for g in gpus):
        return Layout(TENSOR_PARALLEL, 0, 0, 0, 0, "MIG instances cannot be combined (NCCL does not span them)")
    sizes = [n for n in valid_sizes(sizing.shape) if 1 < n <= len(gpus)]
    if not sizes:
        return Layout(TENSOR_PARALLEL, 0, 0, 0, 0, _no_divisor(sizing, len(gpus)))
    options = [_layout(TENSOR_PARALLEL, sizing, gpus, n, utilization, tp=n) for n in sizes]
    full = [o for o in options if o.seqs >= sizing.max_num_seqs]
    return (full or [o for o in options if o.fits] or options[-1:])[0]


def _no_divisor(sizing: Sizing, count: int) -> str:
    from worker.contract.tp_rules import split_sizes

    counts = ", ".join(f"{v} {what}" for what, v in split_sizes(sizing.shape).items())
    if count < 2:
        return "needs 2 or more GPUs"
    return f"no size from 2 to {count} divides the model's {counts}"


def layer_split(sizing: Sizing, gpus: list[GpuInfo], utilization: float) -> Layout:
    """The fewest GPUs (two or more) whose layer split holds one full-length sequence."""
    if len(gpus) < 2:
        return Layout(LAYER_SPLIT, 0, 0, 0, 0, "needs 2 or more GPUs")
    if any(g.is_mig for g in gpus):
        return Layout(LAYER_SPLIT, 0, 0, 0, 0, "MIG instances cannot be combined (one per process)")
    k = min_gpus(sizing, gpus, utilization)
    return _layout(LAYER_SPLIT, sizing, gpus, max(2, k or len(gpus)), utilization)


def compare(sizing: Sizing, gpus: list[GpuInfo], utilization: float, tp_unavailable: str = "") -> list[Layout]:
    """Data parallel, tensor parallel and layer split on ``gpus``, planned for the tightest GPUs."""
    gpus = sorted(gpus, key=lambda g: gpu_budget(g, utilization))
    return [
        data_parallel(sizing, gpus, utilization),
        tensor_parallel(sizing, gpus, utilization, tp_unavailable),
        layer_split(sizing, gpus, utilization),
    ]


def choose(layouts: list[Layout]) -> Layout | None:
    """Data parallel when a replica fits one GPU, else tensor parallel, else a layer split; ``None``
    when none fits."""
    by_kind = {lay.kind: lay for lay in layouts}
    for kind in (DATA_PARALLEL, TENSOR_PARALLEL, LAYER_SPLIT):
        if kind in by_kind and by_kind[kind].fits:
            return by_kind[kind]
    return None


def tp_refusal(cfg: DeployConfig) -> str | None:
    """Why ``workers.tensor_parallel_size`` cannot split ``model.name`` (one line per problem,
    :func:`worker.contract.tp_rules.tp_problems`), read from the model's config alone; ``None`` when it can,
    or when there is no config to read here (resolving the model then says so)."""
    from launcher.models import ModelNotFound
    from launcher.plan.shape import read_shape
    from worker.contract.shapes import ShapeError
    from worker.contract.tp_rules import tp_problems

    if cfg.workers.tensor_parallel_size == 1:
        return None
    try:
        shape = read_shape(cfg.model.name)
    except (ModelNotFound, ShapeError):
        return None
    return "\n".join(tp_problems(shape, cfg.workers.tensor_parallel_size, cfg.model.quantization)) or None
