"""``llamadeploy doctor``'s kernel row: the kernel table a worker would choose here, measured in
process on the configured model's real weight shapes (random values of those shapes, held in the
format the worker loads: quantized as ``model.quantization`` says, or under ``auto`` a GGUF
file's stored types, Q8_0 and Q4_0/Q4_1/Q4_K as int8/int4 groups of 32), for decode steps of
1 … ``max_num_seqs`` rows.

It is the worker's own measurement (:class:`worker.quant.linear.Linears`), on this process's
threads rather than a worker's pinned cores, and without the prefill buckets, so it is quick; each
running worker's full table is in ``GET /workers``. Models whose distinct weights would take more
than :data:`MAX_BYTES` of float32 here are not measured.
"""

from __future__ import annotations

from launcher.config import DeployConfig

MAX_BYTES = 2**30


def shapes(shape) -> dict[str, tuple[int, int]]:
    """The distinct linear weights of a Llama-family model, ``(out, in)``: the fused q/k/v, o, the
    fused gate/up, down, and the LM head."""
    h, d = shape.hidden_size, shape.head_dim
    return {
        "qkv": ((shape.num_heads + 2 * shape.num_kv_heads) * d, h),
        "o": (h, shape.num_heads * d),
        "gate_up": (2 * shape.intermediate_size, h),
        "down": (h, shape.intermediate_size),
        "lm_head": (shape.vocab_size, h),
    }


def stored_types(cfg: DeployConfig, shape) -> dict[str, str]:
    """Under ``model.quantization: auto``, the GGUF types the worker serves as stored (weight name
    -> type: ``Q4_1``...; the LM head's is its own, or the embedding's when tied); {} otherwise (a
    float checkpoint, another setting, types ``auto`` does not serve: quantized as configured)."""
    from worker.contract.shapes import weight_format

    stored = getattr(shape, "gguf_types", None)
    if cfg.model.quantization != "auto" or stored is None or weight_format("auto", stored).problem:
        return {}
    linear = stored.linear.split("+")[0]
    head = (stored.head or stored.embedding).split("+")[0]
    return {name: head if name == "lm_head" else linear for name in shapes(shape)}


def _as_stored(w, gguf_type: str | None):
    """``w`` in GGUF type ``gguf_type``'s layout as the worker holds it (int8 or int4 per group of
    32; a float type, or None: ``w`` itself)."""
    from worker.quant.format import quantize_int4, quantize_int8

    if gguf_type == "Q8_0":
        held = quantize_int8(w, 32)
    elif gguf_type in ("Q4_0", "Q4_1", "Q4_K") and w.shape[1] % 32 == 0:
        held = quantize_int4(w, 32)
    else:
        return w
    held.source = gguf_type
    return held


def measure(cfg: DeployConfig, shape, device: str, dtype_name: str) -> list[str]:
    """One line per weight shape: its format, each bucket's kernel and time. Raises
    ``RuntimeError`` when a shape has no kernel here."""
    import torch

    from worker.model import DTYPES
    from worker.quant.linear import Linears

    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    dtype = DTYPES[dtype_name]
    rows = cfg.workers.max_num_seqs
    linears = Linears(dev, dtype, cfg.model.quantization, max_rows=rows, max_logit_rows=rows)
    stored = stored_types(cfg, shape)
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes(shape).items():
        w = _as_stored((torch.randn(n, k, generator=g) * 0.02).to(device=dev, dtype=dtype), stored.get(name))
        (linears.head if name == "lm_head" else linears)(w)
    return [
        f"{c.n}x{c.k} {c.weight}: "
        + ", ".join(f"≤{p.rows} {p.kernel}" + (f" {p.ms:.3g} ms" if p.ms is not None else "") for p in c.picks)
        for c in linears.report()
    ]


def kernel_check(cfg: DeployConfig, shape, device: str, dtype_name: str) -> tuple[str, str, str]:
    """The doctor row for the kernel table on ``device`` in ``dtype_name``: ``(status, detail,
    fix)``, status ``ok``, ``skip`` or ``fail`` (``launcher.plan.doctor`` makes it a row)."""
    if shape is None:
        return "skip", "no model config to take the weight shapes from", ""
    size = sum(n * k for n, k in shapes(shape).values()) * 4
    if size > MAX_BYTES:
        return (
            "skip",
            f"the model's distinct weights take {size / 2**30:.1f} GiB; not measured here "
            "(each worker's table is in GET /workers and its start-up log)",
            "",
        )
    try:
        lines = measure(cfg, shape, device, dtype_name)
    except RuntimeError as exc:
        return "fail", str(exc), "set model.quantization: none or another model.dtype"
    held = sorted(set(stored_types(cfg, shape).values()))
    as_stored = f" (the file's {'/'.join(held)}, as stored)" if held else ""
    head = (
        f"{device}, {dtype_name}, model.quantization {cfg.model.quantization}{as_stored}, "
        f"rows 1-{cfg.workers.max_num_seqs}:"
    )
    return "ok", "\n".join([head, *lines]), ""
