"""The memory arithmetic of an embedding model: its weights plus the activations of its largest
step; no KV cache (an embedding worker, :mod:`worker.embed`, keeps none) and no LM head.

* weights = the base stack ``AutoModel`` loads, in the compute dtype (embedding workers run float
  weights): a decoder's Llama count without the LM head; an encoder's (BERT family) token,
  position and token-type embeddings, per layer q/k/v/o with biases, a two-matrix GELU MLP with
  biases and two LayerNorms (all-MiniLM-L6-v2: 22,565,376, its count without the unused pooler);
* activations of one step of ``T`` tokens (:func:`worker.contract.embed_spec.step_tokens`, the
  batcher's budget): the chat plan's prefill estimate ``T × (2 × intermediate + 4 × hidden)``
  elements (:func:`launcher.plan.sizing.activation_bytes`: it holds for an encoder layer too, whose
  GELU MLP keeps one ``intermediate``-wide tensor where SwiGLU keeps two) plus the float32 copy of
  the last hidden states pooling reads (``T × hidden × 4`` bytes); no logits. The attention scores
  are not counted: transformers' default attention for these models is PyTorch's
  ``scaled_dot_product_attention``, whose fused kernels do not materialise ``L × L`` per head;
* overhead = the chat plan's per-GPU allowance (or CPU process memory) + those activations, on
  the one device the worker computes on (an embedding worker does not split a model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.plan.placement import GpuInfo, WorkerSpec
from launcher.plan.sizing import CPU_PROCESS_BYTES, GPU_CONTEXT_BYTES, gpu_budget, slot_budget
from worker.contract.embed_spec import EmbedSpec, step_tokens
from worker.contract.shapes import FLOAT_BYTES, ModelShape
from worker.contract.units import GiB

TOKEN_TYPES = 2  # BERT's type_vocab_size (segments A and B); the shape does not carry it


@dataclass(frozen=True)
class EmbedSizing:
    """The arithmetic for one embedding model computing in ``dtype`` with steps of
    ``step_tokens`` tokens (bytes); ``spec`` is the model's :class:`EmbedSpec`."""

    shape: ModelShape
    dtype: str
    step_tokens: int
    weights: int
    activations: int

    @property
    def spec(self) -> EmbedSpec:
        assert self.shape.embed is not None
        return self.shape.embed

    @property
    def label(self) -> str:
        return self.dtype

    def overhead(self, on_gpu: bool) -> int:
        """Allowance (GPU) or process memory (CPU), plus one step's activations."""
        return (GPU_CONTEXT_BYTES if on_gpu else CPU_PROCESS_BYTES) + self.activations

    def need(self, on_gpu: bool) -> int:
        """Bytes one embedding worker needs: weights + overhead."""
        return self.weights + self.overhead(on_gpu)


@dataclass(frozen=True)
class EmbedFit:
    """How one placed embedding worker fares: the ``budget`` it may use against the ``need`` of
    its weights and ``overhead``. ``kv_room`` and ``seqs`` are 0: it holds no KV cache."""

    spec: WorkerSpec
    budget: int
    overhead: int
    need: int
    kv_room: int = 0
    seqs: int = 0

    @property
    def fits(self) -> bool:
        return self.need <= self.budget


def embed_params(shape: ModelShape, spec: EmbedSpec) -> int:
    """Parameters of the stack an embedding worker loads (module docstring)."""
    if not spec.encoder:
        return replace(shape, tie_word_embeddings=True).params  # tied: the table counted once, no LM head
    h, inter = shape.hidden_size, shape.intermediate_size
    positions = shape.max_position_embeddings or spec.max_tokens
    embeddings = (shape.vocab_size + positions + TOKEN_TYPES) * h + 2 * h  # + their LayerNorm
    per_layer = 4 * (h * h + h) + 2 * h * inter + inter + h + 2 * 2 * h
    return embeddings + shape.num_layers * per_layer


def embed_activations(shape: ModelShape, dtype: str, tokens: int) -> int:
    """One step's activation peak for ``tokens`` tokens (module docstring)."""
    element = 4 if dtype == "float32" else 2
    per_token = 2 * shape.intermediate_size + 4 * shape.hidden_size
    return tokens * per_token * element + tokens * shape.hidden_size * 4


def size_embed(shape: ModelShape, dtype: str, max_prefill_tokens: int | str, on_gpu: bool) -> EmbedSizing:
    """The :class:`EmbedSizing` of ``shape`` (whose ``embed`` is set) in ``dtype`` with the step
    budget the worker uses for ``workers.max_prefill_tokens`` on GPU or CPU."""
    spec = shape.embed
    if spec is None:
        raise ValueError(f"{shape.name} is not served for embeddings")
    tokens = step_tokens(max_prefill_tokens, on_gpu, spec.max_tokens)
    weights = embed_params(shape, spec) * FLOAT_BYTES.get(dtype, 2)
    return EmbedSizing(shape, dtype, tokens, weights, embed_activations(shape, dtype, tokens))


def fit_embed(spec: WorkerSpec, sizing: EmbedSizing, utilization: float) -> EmbedFit:
    """GPU: the budget of the first of the worker's GPUs (where it computes): ``min(utilization ×
    share × total, free − (1 − utilization) × total)``. CPU: what it needs (RAM is checked across
    workers by the plan)."""
    on_gpu = spec.device == "cuda"
    need = sizing.need(on_gpu)
    if not on_gpu:
        return EmbedFit(spec, need, sizing.overhead(False), need)
    budget = slot_budget(spec.gpu_info[0], utilization, spec.share)
    return EmbedFit(spec, budget, sizing.overhead(True), need)


def embed_replicas(sizing: EmbedSizing, gpus: list[GpuInfo], utilization: float) -> int:
    """Replicas these GPUs hold: one on each GPU whose budget holds a worker (0: none does)."""
    return sum(sizing.need(True) <= gpu_budget(g, utilization) for g in gpus)


def embed_problems(fits: list[EmbedFit], sizing: EmbedSizing, tensor_parallel_size: int) -> list[str]:
    """One error per worker that does not fit, and one for tensor parallel (refused by the worker)."""
    errors = []
    if tensor_parallel_size > 1:
        errors.append("an embedding model runs on one device: set workers.tensor_parallel_size to 1")
    for f in fits:
        if not f.fits:
            errors.append(
                f"worker {f.spec.worker_id} ({f.spec.label}) may use {f.budget / GiB:.2f} GiB but needs "
                f"{sizing.weights / GiB:.2f} GiB weights ({sizing.label}) + {f.overhead / GiB:.2f} GiB overhead "
                f"(a step of {sizing.step_tokens} tokens) = {f.need / GiB:.2f} GiB; embeddings keep no KV cache: "
                "lower workers.max_prefill_tokens (the step), raise workers.gpu_memory_utilization, or use a larger GPU"
            )
    return errors


def describe(sizing: EmbedSizing) -> str:
    """One line: what the worker is and needs (the preflight's log, the plan's split)."""
    return (
        f"embeddings (no KV cache), inputs up to {sizing.spec.max_tokens} tokens, steps of "
        f"{sizing.step_tokens} tokens, weights {sizing.weights / GiB:.3f} GiB ({sizing.label})"
    )
