"""Memory sizing: weights + KV cache + overhead of one model on one GPU, before anything is loaded.

The arithmetic (the same terms vLLM's and TGI's memory profilers use):

* weights = parameters × bytes per parameter (4 float32, 2 bfloat16/float16, 1 int8, 0.5 int4);
  the parameter count comes from the config (:attr:`ModelShape.params`);
* KV cache per token = 2 (K and V) × layers × kv_heads × head_dim × element bytes (2, or 4 in
  float32; int8/int4 weights still keep a 16-bit cache); the deployment wants it for
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

A tensor-parallel rank (``tensor_parallel_size: N``) holds 1/N of every attention and MLP
matrix plus the replicated embeddings, norms and LM head (:mod:`worker.contract.tp_rules`), 1/N of the KV
heads (so 1/N of a token's KV bytes), and a prefill step's activations with the MLP's channels
split N ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan.placement import GpuInfo
from worker.contract import shapes
from worker.contract.budget import GPU_ALLOWANCE_BYTES, GpuFacts, KvBudget, kv_budget
from worker.contract.shapes import ModelShape
from worker.contract.units import GiB

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}
SERVABLE_DTYPES = ("float32", "bfloat16", "float16")
GPU_CONTEXT_BYTES = GPU_ALLOWANCE_BYTES
CPU_PROCESS_BYTES = 3 * GiB // 4


def weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of the weights at ``dtype`` (one of :data:`DTYPE_BYTES`); quantized formats' scales
    (a few percent) are not counted."""
    return int(shape.params * DTYPE_BYTES[dtype])


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """:func:`worker.contract.shapes.kv_bytes_per_token` of ``shape`` with weights at ``dtype``: the cache
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
