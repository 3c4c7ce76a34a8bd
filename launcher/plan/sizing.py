"""Memory sizing: weights + KV cache + overhead of one model on one GPU, before anything is loaded.

The arithmetic (the same terms vLLM's and TGI's memory profilers use):

* weights = :func:`worker.contract.shapes.weight_bytes`, the one rule for the weights' bytes as
  held: every parameter in the compute dtype (4 bytes float32, 2 bfloat16/float16), except what
  ``model.quantization`` quantizes (:func:`worker.contract.shapes.weight_format`: the linear layers
  at 8 or 4 bits per value plus float32 scales, and offsets at 4 bits; the embeddings and LM head
  at 8 bits per row when quantizing at load); the shape comes from the config (:class:`ModelShape`);
* KV cache per token = 2 (K and V) × layers × kv_heads × head_dim × element bytes (the compute
  dtype's: 4 in float32, else 2, quantized weights or not); the deployment wants it for
  ``max_num_seqs × max_model_len`` tokens, and at the very least for one ``max_model_len`` sequence;
* overhead = per GPU, an allowance for the CUDA context, workspaces and fragmentation
  (:data:`worker.contract.budget.GPU_ALLOWANCE_BYTES`, 1 GiB) + one prefill chunk's activations
  (``max_prefill_tokens × (2 × intermediate + 4 × hidden)`` elements) + the last-position float32
  logits of a full batch; on CPU 0.75 GiB of process memory + the same activations.

A GPU worker's KV room is :func:`worker.contract.budget.kv_budget`, the rule the worker itself applies
after warm-up (with measured weights and activation peak where this module estimates them): the
smaller of ``total × gpu_memory_utilization × share − weights − activations − allowance`` and
what free memory allows once other processes are counted, per GPU, the tightest GPU of a layer
split bounding the tokens. GB means 1e9 bytes, GiB 2^30.

A tensor-parallel rank (``tensor_parallel_size: N``) holds its 1/N shard of every attention and
MLP matrix (quantized or not) plus the replicated embeddings, norms and LM head
(:mod:`worker.contract.tp_rules`), 1/N of the KV heads (so 1/N of a token's KV bytes), and a
prefill step's activations with the MLP's channels split N ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan.placement import GpuInfo
from worker.contract import shapes
from worker.contract.budget import GPU_ALLOWANCE_BYTES, GpuFacts, KvBudget, kv_budget, reserve
from worker.contract.shapes import UNQUANTIZED, ModelShape, WeightBytes, WeightFormat, weight_bytes
from worker.contract.units import GiB

QUANTIZATIONS = ("none", "int8", "int4")  # what plan may suggest (auto is resolved per model)
GPU_CONTEXT_BYTES = GPU_ALLOWANCE_BYTES
CPU_PROCESS_BYTES = 3 * GiB // 4


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """:func:`worker.contract.shapes.kv_bytes_per_token` of ``shape`` computing in ``dtype``: the
    cache is float32 for float32, else 16-bit (whatever the weights' quantization)."""
    element = 4 if dtype == "float32" else 2
    return shapes.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, element)


@dataclass(frozen=True)
class Sizing:
    """The arithmetic for one model, compute dtype, weight format and set of limits (bytes)."""

    shape: ModelShape
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_prefill_tokens: int
    held: WeightBytes
    kv_per_token: int
    activations: int
    fmt: WeightFormat = UNQUANTIZED

    @property
    def weights(self) -> int:
        """All the weights' bytes (:func:`worker.contract.shapes.weight_bytes`)."""
        return self.held.total

    @property
    def label(self) -> str:
        """What the weights are held in: ``"bfloat16"``, ``"int8 + bfloat16"`` (linear layers + the rest)."""
        return f"{self.fmt.label} + {self.dtype}" if self.fmt.label else self.dtype

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


def tp_rank_weights(sizing: Sizing, tp: int) -> int:
    """Bytes of one rank's weights in a ``tp``-way tensor-parallel replica: its shard of every linear
    layer, the embeddings, LM head and norms whole (:func:`worker.contract.shapes.weight_bytes`)."""
    return weight_bytes(sizing.shape, sizing.dtype, sizing.fmt, tp).total


def tp_rank_activations(sizing: Sizing, tp: int) -> int:
    """One rank's activation peak (:func:`activation_bytes` with the MLP split ``tp`` ways)."""
    s = sizing
    return activation_bytes(s.shape, s.dtype, s.max_model_len, s.max_num_seqs, s.max_prefill_tokens, tp)


def size(
    shape: ModelShape,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    max_prefill_tokens: int,
    fmt: WeightFormat = UNQUANTIZED,
) -> Sizing:
    """Compute the :class:`Sizing` computing in ``dtype`` (a key of
    :data:`worker.contract.shapes.FLOAT_BYTES`) with the weights held in ``fmt``."""
    return Sizing(
        shape,
        dtype,
        max_model_len,
        max_num_seqs,
        max_prefill_tokens,
        weight_bytes(shape, dtype, fmt),
        kv_bytes_per_token(shape, dtype),
        activation_bytes(shape, dtype, max_model_len, max_num_seqs, max_prefill_tokens),
        fmt,
    )


def resize(sizing: Sizing, dtype: str, fmt: WeightFormat | None = None) -> Sizing:
    """The same model and limits at another ``dtype`` (and weight format: unchanged if ``None``)."""
    s = sizing
    return size(s.shape, dtype, s.max_model_len, s.max_num_seqs, s.max_prefill_tokens, s.fmt if fmt is None else fmt)


def slot_budget(gpu: GpuInfo | GpuFacts, utilization: float, share: float) -> int:
    """Bytes a placed worker may use on one of its GPUs: ``min(utilization × share × total, free −
    (1 − utilization) × total)`` (0 at least): its share of the card, and no more than the card has
    free while leaving the part ``gpu_memory_utilization`` keeps back (:func:`worker.contract.budget.reserve`)."""
    return max(
        0, min(int(gpu.total_bytes * utilization * share), gpu.free_bytes - reserve(gpu.total_bytes, utilization))
    )


def gpu_budget(gpu: GpuInfo, utilization: float) -> int:
    """Bytes a worker may use on an idle-for-us ``gpu``: ``utilization × total − used`` (0 at least)."""
    return max(0, int(gpu.total_bytes * utilization) - gpu.used_bytes)


def planned_facts(
    gpus: tuple[GpuInfo, ...] | list[GpuInfo], sizing: Sizing, utilization: float, share: float = 1.0, tp: int = 1
) -> list[GpuFacts]:
    """The facts :func:`worker.contract.budget.kv_budget` needs, as planned before loading: NVML's free
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
    """:func:`worker.contract.budget.kv_budget` over :func:`planned_facts`."""
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
