"""What a worker loads, decided in one place (torch-free).

:func:`resolve_load_plan` turns the ``model`` and ``workers`` settings, the machine
(:class:`Machine`: device, GPUs' compute capabilities and memory, CPU flags) and the model's files
(:class:`ModelFacts`: task, config, a GGUF file's stored types) into one frozen :class:`LoadPlan`:
the task, the compute dtype (weights, KV cache and kernels), the forward pass, where the weights come
from and how they are held, this rank's shard, the GPU memory cap and a layer split's per-GPU bytes.
The worker resolves it once at start (``worker.model.plan_load``), logs :meth:`LoadPlan.describe`
in one line and hands the plan down; the loading code (``worker.replica``, ``worker.model``,
``worker.embed.load``) carries it out and decides nothing again. ``llamadeploy doctor`` resolves
the same plan for the machine it checks.

The rules it applies each have one home: ``model.dtype`` in :mod:`worker.contract.dtypes`, the
tensor-parallel split in :mod:`worker.contract.tp_rules`, the weights' format in
:func:`worker.contract.shapes.weight_format`, the Llama-family forward in
:mod:`worker.contract.llama_family`, the memory cap in :func:`worker.contract.budget.memory_fraction`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from worker.contract import dtypes
from worker.contract.budget import memory_fraction
from worker.contract.llama_family import supports
from worker.contract.shapes import QUANT_BITS, GgufTypes, WeightFormat, weight_format
from worker.contract.tp_rules import tp_problems

Task = Literal["generate", "embed"]
Forward = Literal["llama", "transformers", "embed"]  # worker.llama, worker.hf_model, worker.embed
Source = Literal["safetensors", "gguf", "random"]


@dataclass(frozen=True)
class Machine:
    """The facts about a worker's machine a load plan depends on. ``device``: ``"cpu"`` or
    ``"cuda"``; ``gpu_capabilities``: each visible GPU's compute capability (major, minor);
    ``gpu_bytes``: each visible GPU's total memory, bytes; ``cpu_flags``: ``/proc/cpuinfo``'s;
    ``share``: this worker's share of each GPU (``workers.workers_per_gpu``: 1/N)."""

    device: str
    gpu_capabilities: tuple[dtypes.Capability, ...] = ()
    gpu_bytes: tuple[int, ...] = ()
    cpu_flags: frozenset[str] = frozenset()
    share: float = 1.0


@dataclass(frozen=True)
class ModelFacts:
    """The facts about the model folder a load plan depends on: its ``task``
    (:func:`worker.contract.tasks.resolve_task`), its ``config`` (a transformers config object, its
    config.json as a dict or a :class:`~worker.contract.shapes.ModelShape`; None for an embedding
    model), the ``gguf`` file it is served from as stored (:func:`worker.contract.gguf_link.gguf_file`)
    and that file's tensor types (``stored``; None for a float checkpoint or an unreadable header)."""

    path: str
    task: Task = "generate"
    config: Any = None
    gguf: str | None = None
    stored: GgufTypes | None = None


@dataclass(frozen=True)
class LoadPlan:
    """What one worker process loads, and where. Made by :func:`resolve_load_plan` only.

    ``dtype``: the compute dtype's name (the float weights, the KV cache, the kernels' inputs);
    ``forward``: ``llama`` (the engine's compact forward), ``transformers`` (any decoder, or a
    layer split) or ``embed``; ``source``: the weights' files (``gguf``: ``gguf_file`` as stored);
    ``quantization``: what the linear layers are quantized to at load (``int8``/``int4``/``none``);
    ``weight_format``: how the weights are then held; ``rank`` of ``world`` tensor-parallel ranks;
    ``max_memory``: a layer split's bytes per GPU index (None: one device); ``memory_fraction``: the
    allocator's cap per GPU (None on CPU); ``rows``: the most rows a step's linears and the LM head
    see (the kernel table's buckets); ``problem``: why this plan cannot load ("" when it can)."""

    model_path: str
    task: Task
    device: str
    dtype: str
    dtype_note: str  # dtypes.describe: the choice and why
    dtype_warning: str  # dtypes.warning: why an explicit dtype is a poor fit here, or ""
    forward: Forward
    forward_note: str  # why transformers runs it, or ""
    source: Source
    gguf_file: str | None
    quantization: str
    weight_format: WeightFormat
    rank: int
    world: int
    max_memory: tuple[tuple[int, int], ...] | None
    memory_fraction: float | None
    share: float
    max_model_len: int | str
    prefill_budgets: tuple[int, int]  # prompt tokens per step beside decodes, and alone
    rows: tuple[int, int]
    deterministic: bool
    problem: str = ""
    config: Any = field(default=None, compare=False, repr=False)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def gpu_max_memory(self) -> dict[int, int] | None:
        """:attr:`max_memory` as transformers' ``max_memory`` argument."""
        return dict(self.max_memory) if self.max_memory else None

    def check(self) -> None:
        """Raise ``ValueError`` with :attr:`problem` when the plan cannot be loaded."""
        if self.problem:
            raise ValueError(self.problem)

    def describe(self) -> str:
        """One line for the worker's log: task, device and shard, dtype, forward, weights, kernels, memory."""
        where = self.device + (f" rank {self.rank} of {self.world}" if self.world > 1 else "")
        parts = [f"{self.task} on {where}", f"dtype {self.dtype_note}"]
        if self.task == "embed":
            return "; ".join(parts)
        parts.append(f"forward {self.forward}" + (f" ({self.forward_note})" if self.forward_note else ""))
        parts.append(f"weights {self._weights()}")
        parts.append(
            f"kernels in {self.dtype} for up to {self.rows[0]} rows (LM head {self.rows[1]})"
            + (", batch-invariant" if self.deterministic else "")
        )
        if self.memory_fraction is not None:
            parts.append(f"GPU memory fraction {self.memory_fraction:.3g}")
        if self.max_memory:
            parts.append(f"layers split over {len(self.max_memory)} GPUs")
        return "; ".join(parts)

    def _weights(self) -> str:
        origin = {"gguf": f"from {self.gguf_file}", "random": "random (model.random_init)"}
        fmt = self.weight_format
        held = fmt.name if fmt.name else "unquantized"
        if fmt.quantized:
            held += " at load" if fmt.name in QUANT_BITS else " as stored"
        elif fmt.name:
            held = f"{fmt.name} dequantized"
        return f"{origin.get(self.source, 'from safetensors')}, {held}"


def resolve_load_plan(model, workers, machine: Machine, facts: ModelFacts, rank: int = 0, world: int = 1) -> LoadPlan:
    """The :class:`LoadPlan` of a worker with the ``model`` and ``workers`` settings sections
    (:class:`~worker.contract.settings.ModelConfig`, :class:`~worker.contract.settings.WorkersConfig`,
    or a deploy.yaml's), on ``machine``, for the model ``facts`` describe; ``rank`` of ``world``
    tensor-parallel ranks. Pure: no torch, no files. A plan that cannot load comes back with
    :attr:`LoadPlan.problem` set (:meth:`LoadPlan.check` raises it); an unknown ``model.dtype``
    raises ``ValueError``."""
    caps = machine.gpu_capabilities if machine.device == "cuda" else ()
    name = dtypes.resolve(model.dtype, machine.device, caps, machine.cpu_flags)
    on_gpu = machine.device == "cuda"
    split = on_gpu and len(machine.gpu_bytes) > 1
    why = supports(facts.config) if facts.task != "embed" else None  # None: the compact forward runs it
    prefill, idle = workers.prefill_budgets(on_gpu)
    budget = workers.gpu_memory_utilization * machine.share
    return LoadPlan(
        model_path=facts.path,
        task=facts.task,
        device=machine.device,
        dtype=name,
        dtype_note=dtypes.describe(model.dtype, machine.device, caps, machine.cpu_flags),
        dtype_warning=dtypes.warning(name, machine.device, caps, machine.cpu_flags),
        forward=_forward(facts.task, why, split),
        forward_note=why or ("layer split over several GPUs" if split and facts.task != "embed" else ""),
        source="random" if model.random_init else "gguf" if facts.gguf else "safetensors",
        gguf_file=facts.gguf,
        quantization=model.quantization if model.quantization in QUANT_BITS else "none",
        weight_format=weight_format(model.quantization, facts.stored if facts.gguf else None),
        rank=rank,
        world=world,
        max_memory=tuple((i, int(total * budget)) for i, total in enumerate(machine.gpu_bytes)) if split else None,
        memory_fraction=memory_fraction(workers.gpu_memory_utilization, machine.share) if on_gpu else None,
        share=machine.share,
        max_model_len=model.max_model_len,
        prefill_budgets=(prefill, idle),
        rows=(workers.max_num_seqs + idle, workers.max_num_seqs),  # a step's most rows; the LM head's
        deterministic=workers.deterministic,
        problem=_problem(model, facts, world, why, split),
        config=facts.config,
    )


def _forward(task: Task, why: str | None, split: bool) -> Forward:
    """The forward pass that runs the model: ``why`` the compact one cannot (None: it can)."""
    if task == "embed":
        return "embed"
    return "llama" if why is None and not split else "transformers"


def _problem(model, facts: ModelFacts, world: int, why: str | None, split: bool) -> str:
    """Why the settings cannot load this model here, or "": the first of the checks, in order."""
    if facts.task == "embed":
        return "an embedding model runs on one device: set workers.tensor_parallel_size to 1" if world > 1 else ""
    compact = why is None and not split
    where = why or "not with workers.gpus_per_replica > 1"
    if model.quantization in QUANT_BITS and not compact:
        return (
            f"model.quantization: {model.quantization} needs a Llama-family model on one device ({where}); "
            "use model.quantization: none"
        )
    if world > 1:
        if not compact:
            return (
                f"workers.tensor_parallel_size: {world} needs a Llama-family model on one GPU per rank ({where}); "
                "use workers.tensor_parallel_size: 1"
            )
        if problems := tp_problems(facts.config, world, model.quantization):
            return "; ".join(problems)
    if facts.gguf and not compact:
        return (
            "a GGUF file is served as stored on the engine's Llama-family forward on one device only "
            f"({where}); set model.quantization: none"
        )
    if model.random_init and not compact:
        return f"model.random_init needs a Llama-family model on one device ({why or 'layer split'})"
    return ""
