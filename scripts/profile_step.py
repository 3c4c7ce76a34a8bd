"""Where a batch-1 decode step's time goes: the embedded model in process, torch.profiler, one thread.

Usage: ``PYTHONPATH=. python scripts/profile_step.py [--dtype float32|bfloat16] [--quantization int8]
[--steps 20] [--rounds 5] [--context 45] [--top 15]``. Prints the tensor operations per step (all
levels and top level), the matmuls' share of the operations' own time and of the step's wall time,
and the operations that took the most time. Each figure is the fastest of ``--rounds`` rounds of
``--steps`` steps (unprofiled and profiled rounds apart): other processes only add time, so the
fastest round is the one they disturbed least. On a shared machine only the counts are firm; the
shares are what the runs gave (docs/benchmarks/results.md, "Time outside the matmuls").
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from launcher.models import resolve_model
from worker import model as model_mod
from worker.attention import KVCache
from worker.runner import ModelRunner

CPU = torch.device("cpu")
BLOCK = 16
# the operations that multiply a weight (every candidate kernel of worker/quant/kernels.py)
MATMULS = ("mm", "addmm", "linear", "matmul", "mkldnn", "int8pack", "int4pack", "dyn_quant", "bmm")


def is_matmul(name: str) -> bool:
    """Whether a profiler event named ``name`` is a weight's matmul (aten::mm, oneDNN's linear, ...)."""
    return any(m in name for m in MATMULS) and "scaled_dot_product" not in name


def load(dtype: str, quantization: str) -> ModelRunner:
    """The embedded model on CPU with a cache for one sequence, as a runner."""
    path = str(resolve_model("smollm2-135m-instruct", progress=False, quantization=quantization))
    config = model_mod.load_config(path)
    dt = model_mod.DTYPES[dtype]
    model = model_mod.load_model(path, config, CPU, dt, 2048, quantization=quantization, rows=(1, 1))
    layers, kv_heads, head_dim = model_mod.kv_shape(config)
    cache = KVCache(layers, 64, BLOCK, kv_heads, head_dim, dt, CPU)
    return ModelRunner(model, cache, CPU)


def decode_step(runner: ModelRunner, context: int) -> None:
    """One batch-1 decode step at ``context`` tokens (the whole cache's first blocks are its table)."""
    table = list(range(-(-context // BLOCK)))
    ids = torch.tensor([1], dtype=torch.long)
    pos = torch.tensor([context - 1], dtype=torch.long)
    runner.forward(ids, pos, [(table, context)], [], torch.tensor([0], dtype=torch.long))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=45)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    runner = load(a.dtype, a.quantization)
    table = list(range(-(-a.context // BLOCK)))
    ids = torch.arange(a.context, dtype=torch.long)
    runner.forward(ids, ids.clone(), [], [(table, 0, a.context)], torch.tensor([a.context - 1]))
    for _ in range(5):
        decode_step(runner, a.context)
    plain = min(timed(runner, a.steps, a.context) for _ in range(a.rounds))
    best = None
    for _ in range(a.rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = timed(runner, a.steps, a.context)
        if best is None or wall < best[1]:
            best = (prof, wall)
    report(best[0], a.steps, plain, best[1], a.top)


def timed(runner: ModelRunner, steps: int, context: int) -> float:
    """Seconds per decode step over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        decode_step(runner, context)
    return (time.perf_counter() - start) / steps


def report(prof, steps: int, plain: float, wall: float, top: int) -> None:
    """Print the counts, the shares and the ``top`` operations by their own time."""
    events = [e for e in prof.events() if e.name.startswith("aten::") or "::" in e.name]
    top_level = [e for e in events if e.cpu_parent is None]
    self_us = sum(e.self_cpu_time_total for e in events)
    mat_us = sum(e.self_cpu_time_total for e in events if is_matmul(e.name))
    print(f"step: {plain * 1e3:.2f} ms unprofiled, {wall * 1e3:.2f} ms profiled")
    print(f"operations per step: {len(events) / steps:.0f} (top level {len(top_level) / steps:.0f})")
    print(f"non-matmul share of the operations' own time: {1 - mat_us / self_us:.1%}")
    print(f"non-matmul share of the step's wall time: {1 - mat_us / steps / 1e6 / wall:.1%}")
    print(f"  (unprofiled step: {1 - mat_us / steps / 1e6 / plain:.1%}, matmuls timed under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


if __name__ == "__main__":
    main()
