"""Loading one model replica onto this process's device, as its load plan says.

The launcher has already resolved ``model_path`` to a local Hugging Face folder (config.json,
safetensors or a link to a GGUF file, tokenizer files) and set ``CUDA_VISIBLE_DEVICES`` before this
process imported torch. :func:`plan_load` reads the machine and the folder once and resolves what
to load (:func:`worker.contract.load_plan.resolve_load_plan`); :func:`load_model` carries the plan
out. Llama-family models run on the engine's own forward pass (:mod:`worker.llama`); weights load
straight onto the device.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from worker import llama
from worker.contract.load_plan import LoadPlan, Machine, ModelFacts, resolve_load_plan
from worker.contract.settings import ModelConfig, WorkerSettings
from worker.contract.shapes import attention_dims

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """The torch device of a plan's ``"cpu"`` or ``"cuda"`` (this process sees only its own GPUs,
    so always ``cuda:0``)."""
    return torch.device("cuda:0" if device == "cuda" else "cpu")


def machine_facts(device: str, share: float = 1.0) -> Machine:
    """This process's machine as :func:`worker.contract.load_plan.resolve_load_plan` reads it: the
    visible GPUs' compute capabilities and memory (``device`` ``"cuda"``), the CPU's flags, this
    worker's ``share`` of each GPU. Raises ``RuntimeError`` when ``"cuda"`` is asked and torch sees none."""
    from worker.contract import dtypes
    from worker.gpus import capabilities

    if device == "cpu":
        return Machine("cpu", cpu_flags=dtypes.cpu_flags())
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    totals = tuple(int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count()))
    return Machine("cuda", tuple(capabilities()), totals, dtypes.cpu_flags(), share)


def model_facts(model: ModelConfig, model_path: str) -> ModelFacts:
    """What the model folder says about loading it: its task, config (a decoder's), and the GGUF
    file it is served from as stored with that file's tensor types (None when the header is not
    readable: the load itself then says why)."""
    from worker.contract.gguf_header import read_tensor_types
    from worker.contract.gguf_link import gguf_file
    from worker.contract.shapes import gguf_types
    from worker.contract.tasks import resolve_task

    task = resolve_task(model, model_path)
    if task == "embed":
        return ModelFacts(model_path, task)
    source = gguf_file(model_path)
    stored = None
    if source is not None:
        try:
            stored = gguf_types(read_tensor_types(source))
        except (OSError, ValueError):
            pass
    return ModelFacts(model_path, task, load_config(model_path), str(source) if source else None, stored)


def plan_load(cfg: WorkerSettings, model_path: str, device: str, share: float = 1.0, rank: int = 0, world: int = 1):
    """This worker's :class:`~worker.contract.load_plan.LoadPlan`, resolved once from its settings,
    its machine and its model folder, and logged in one line. Raises ``ValueError`` when the plan
    cannot load (:meth:`~worker.contract.load_plan.LoadPlan.check`), ``RuntimeError`` for a missing GPU."""
    facts = model_facts(cfg.model, model_path)
    plan = resolve_load_plan(cfg.model, cfg.workers, machine_facts(device, share), facts, rank, world)
    log.info("load plan: %s", plan.describe())
    if plan.dtype_warning:
        log.warning("model.dtype %s: %s", plan.dtype, plan.dtype_warning)
    plan.check()
    return plan


def plan_in_process(
    model_path: str,
    dtype: str | torch.dtype = "float32",
    max_model_len: int = 2048,
    quantization: str = "none",
    rows: tuple[int, int] = (8, 8),
    **workers,
):
    """The CPU load plan of a replica built in this process (tests, benchmarks, scripts): the
    worker's own resolver over settings of ``dtype`` (a name or a torch dtype), ``max_model_len``,
    ``quantization`` and ``workers`` keys (``deterministic`` off unless given: the fastest kernels),
    with the kernels tuned for ``rows`` (a step's, the LM head's)."""
    name = str(dtype).removeprefix("torch.")
    model = {"dtype": name, "max_model_len": max_model_len, "quantization": quantization}
    workers = {"devices": "cpu", "deterministic": False, **workers}
    cfg = WorkerSettings.model_validate({"model": model, "workers": workers})
    facts = model_facts(cfg.model, model_path)
    plan = replace(resolve_load_plan(cfg.model, cfg.workers, machine_facts("cpu"), facts), rows=rows)
    plan.check()
    return plan


def load_config(model_path: str):
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(model_path: str):
    return AutoTokenizer.from_pretrained(model_path)


def eos_ids(model_path: str, config, tokenizer) -> set[int]:
    """End-of-sequence token ids: generation_config.json's, else config.json's, else the tokenizer's."""
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    eos = eos if eos is not None else getattr(config, "eos_token_id", None)
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


def load_model(plan: LoadPlan, tp=None, shared=None):
    """The replica's forward pass with its weights, as ``plan`` says: the compact Llama-family one
    (:mod:`worker.llama`) over the safetensors, the GGUF file as stored or random weights, else
    transformers' own model over the same block cache (:mod:`worker.hf_model`), also for a replica
    split by layers over several GPUs. ``tp``: this rank's :class:`worker.tp.TPGroup` (its
    collectives). The compact path's linears (``model.linears``, :class:`worker.quant.linear.Linears`)
    run the kernels measured fastest here, reading and adding to the ``shared`` kernel table.
    Raises ``ValueError`` for a plan that cannot load."""
    plan.check()
    config, device, dtype = plan.config, pick_device(plan.device), DTYPES[plan.dtype]
    rank, world = plan.rank, plan.world
    if plan.forward == "llama":
        if plan.source == "random":
            weights = llama.random_weights(config, device, dtype, rank=rank, world=world)
        elif plan.source == "gguf":
            from worker.quant.gguf import load_gguf_weights

            weights = load_gguf_weights(plan.gguf_file, config, device, dtype, rank=rank, world=world)
        else:
            weights = llama.load_weights(plan.model_path, device, dtype, rank=rank, world=world)
        return _compact(plan, weights, tp, shared)
    from worker.hf_model import HFModel

    log.info("running %s through transformers (%s)", plan.model_path, plan.forward_note)
    return HFModel.load(plan.model_path, dtype, device, plan.gpu_max_memory)


def _compact(plan: LoadPlan, weights, tp, shared):
    """:class:`worker.llama.LlamaModel` over :class:`worker.quant.linear.Linears`; logs the kernel
    table and the bytes of the weights it holds."""
    from worker.quant.linear import Linears

    device, dtype, deterministic = pick_device(plan.device), DTYPES[plan.dtype], plan.deterministic
    agree = tp.rank0_ints if tp is not None and tp.world > 1 else None  # the ranks run rank 0's kernels
    linears = Linears(
        device,
        dtype,
        plan.quantization,
        max_rows=plan.rows[0],
        max_logit_rows=plan.rows[1],
        agree=agree,
        shared=shared,
        deterministic=deterministic,
    )
    model = llama.LlamaModel(
        plan.config,
        weights,
        device,
        dtype,
        plan.max_model_len,
        linear=linears,
        tp=tp,
        head_linear=linears.head,
        embedding=linears.embedding,
    )
    model.invariant = deterministic
    linears.count(model.norm)
    for layer in model.layers:
        for t in (layer.attn_norm, layer.mlp_norm, layer.qkv_bias, layer.o_bias):
            linears.count(t)
    linears.log_table()
    model.linears = linears
    return model


def layer_devices(model, device: torch.device) -> list[torch.device]:
    """The device of each decoder layer's KV cache."""
    return model.layer_devices() if hasattr(model, "layer_devices") else [device] * model.num_layers


def kv_shape(config, world: int = 1) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder config (:func:`worker.contract.shapes.attention_dims`). ``world``: tensor-parallel
    ranks, each of which holds ``kv_heads / world`` of the heads."""
    _, kv_heads, head_dim = attention_dims(config)
    return config.num_hidden_layers, kv_heads // world, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype, world: int = 1) -> int:
    """KV-cache bytes one token costs in ``dtype`` (:func:`worker.contract.shapes.kv_bytes_per_token`), on
    one of ``world`` tensor-parallel ranks."""
    from worker.contract.shapes import kv_bytes_per_token as formula

    return formula(*kv_shape(config, world), torch.empty((), dtype=dtype).element_size())
