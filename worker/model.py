"""Loading one model replica onto this process's device.

The launcher has already resolved ``model_path`` to a local Hugging Face folder (config.json,
safetensors, tokenizer files) and set ``CUDA_VISIBLE_DEVICES`` before this process imported torch.
Llama-family models run on the engine's own forward pass (:mod:`worker.llama`); weights load
straight onto the device.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from worker import llama
from worker.contract import tp_rules
from worker.contract.shapes import attention_dims

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """``"cpu"`` or ``"cuda"`` (this process sees only its own GPUs, so always ``cuda:0``)."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    return torch.device("cuda:0")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively (GPUs from compute capability 8.0,
    CPUs with avx512_bf16 or AMX), float16 on older GPUs, float32 on other CPUs (:mod:`worker.contract.dtypes`)."""
    from worker.contract import dtypes
    from worker.gpus import capabilities

    caps = capabilities() if device.type == "cuda" else ()
    name = dtypes.resolve(dtype, device.type, caps, dtypes.cpu_flags())
    if why := dtypes.warning(name, device.type, caps, dtypes.cpu_flags()):
        log.warning("model.dtype %s: %s", name, why)
    return DTYPES[name]


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


def load_model(
    model_path: str,
    config,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    random_init: bool = False,
    max_memory: dict | None = None,
    tp=None,
    quantization: str = "none",
    rows: tuple[int, int] = (8, 8),
    deterministic: bool = False,
    shared: dict | None = None,
):
    """The replica's forward pass with its weights: the compact Llama-family one (:mod:`worker.llama`)
    where it applies, else transformers' own model over the same block cache (:mod:`worker.hf_model`),
    also for a replica split by layers over several GPUs (``max_memory``). ``random_init``, tensor
    parallelism (``tp``: this rank's shards) and ``quantization`` (``int8``/``int4``) need the compact
    path, whose linears (``model.linears``, :class:`worker.quant.linear.Linears`: steps of up to ``rows[0]``
    rows, the LM head ``rows[1]``; batch-invariant, with attention, when ``deterministic``; reading and
    adding to the ``shared`` kernel table) run the kernels measured fastest here. Raises ``ValueError``."""
    why = llama.supports(config)
    rank, world = (tp.rank, tp.world) if tp is not None else (0, 1)
    if quantization in ("int8", "int4") and (why or max_memory):
        raise ValueError(
            f"model.quantization: {quantization} needs a Llama-family model on one device "
            f"({why or 'not with workers.gpus_per_replica > 1'}); use model.quantization: none"
        )
    if world > 1:
        if why or max_memory:
            raise ValueError(
                f"workers.tensor_parallel_size: {world} needs a Llama-family model on one GPU per rank "
                f"({why or 'not with workers.gpus_per_replica > 1'}); use workers.tensor_parallel_size: 1"
            )
        if problems := tp_rules.tp_problems(config, world, quantization):
            raise ValueError("; ".join(problems))
    from worker.contract.gguf_link import gguf_file

    source = gguf_file(model_path)
    if source is not None and (why or max_memory):
        raise ValueError(
            f"a GGUF file is served as stored on the engine's Llama-family forward on one device only "
            f"({why or 'not with workers.gpus_per_replica > 1'}); set model.quantization: none"
        )
    if why is None and not max_memory:
        if random_init:
            weights = llama.random_weights(config, device, dtype, rank=rank, world=world)
        elif source is not None:
            from worker.quant.gguf import load_gguf_weights

            weights = load_gguf_weights(source, config, device, dtype, rank=rank, world=world)
        else:
            weights = llama.load_weights(model_path, device, dtype, rank=rank, world=world)
        return _compact(config, weights, device, dtype, max_positions, tp, quantization, rows, deterministic, shared)
    if random_init:
        raise ValueError(f"model.random_init needs a Llama-family model on one device ({why or 'layer split'})")
    from worker.hf_model import HFModel

    log.info("running %s through transformers (%s)", model_path, why or "layer split over several GPUs")
    return HFModel.load(model_path, dtype, device, max_memory)


def _compact(config, weights, device, dtype, max_positions, tp, quantization, rows, deterministic=False, shared=None):
    """:class:`worker.llama.LlamaModel` over :class:`worker.quant.linear.Linears`; logs the kernel
    table and the bytes of the weights it holds."""
    from worker.quant.linear import Linears

    agree = tp.rank0_ints if tp is not None and tp.world > 1 else None  # the ranks run rank 0's kernels
    linears = Linears(
        device,
        dtype,
        quantization,
        max_rows=rows[0],
        max_logit_rows=rows[1],
        agree=agree,
        shared=shared,
        deterministic=deterministic,
    )
    model = llama.LlamaModel(
        config,
        weights,
        device,
        dtype,
        max_positions,
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
