"""Where a batch-1 decode step's time goes: the embedded model in process, torch.profiler, one thread
unless ``--threads`` says more.

Usage: ``PYTHONPATH=. python scripts/profile_step.py [--dtype float32|bfloat16] [--quantization int8|auto]
[--capture] [--deterministic] [--threads 1] [--steps 20] [--rounds 5] [--context 45] [--top 15]``.
``--capture`` profiles the captured decode step (:mod:`worker.step`) instead of the eager forward pass;
``--deterministic`` runs the kernels a default worker runs (one row-invariant kernel per weight,
chosen over a served worker's buckets) instead of the fastest at one row. Prints the tensor
operations per step (all levels and top level), the matmuls' share of the operations' own time and
of the step's wall time, and the operations that took the most time. Each figure is the fastest of
``--rounds`` rounds of ``--steps`` steps (unprofiled and profiled rounds apart): other processes
only add time, so the fastest round is the one they disturbed least.

On a shared machine wall time also counts the other processes' turns on the core, so it also prints
the figures by this thread's CPU time (``time.thread_time``): the step's, and that of the same
linears (the layers' four, the LM head) called alone on inputs of their shapes and dtypes; the
non-matmul share by CPU time is ``1 - linears / step``, the figure docs/benchmarks/results.md quotes ("Time outside the matmuls"),
and the rate the weights are read at (the bytes held over each time). The fused
operators are not profiler events: under ``--capture`` only the CPU-time share counts them.

That share subtracts two large, separately timed figures; on a 2-core VM their noise moved it between
12 % and 23 % for the same build. Under ``--capture`` it also prints the share measured directly: the
captured step against the same step with every linear returning a fixed tensor (rounds alternating),
so what is left is the step's time outside its matmuls, not a difference of two noisy times. The two
differ by what the linears lose to running inside the step (their weights' cache lines evicted by the
rest, the second thread woken) against running back to back alone.

``--threads 2`` runs torch (and the kernels in its thread pool) on two threads, as a worker on a
2-core machine does: a kernel that leaves the second thread idle shows there and not on one thread.
The CPU time is then the calling thread's only: work the second thread takes lowers it, and spinning at
a barrier while the other thread waits for a core (a loaded machine) raises it.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.profiler import ProfilerActivity, profile

from launcher.models import resolve_model
from worker import model as model_mod
from worker.attention import KVCache
from worker.runner import ModelRunner
from worker.step import capture as step_capture

CPU = torch.device("cpu")
BLOCK = 16
SERVED_ROWS = (128, 8)  # a default worker's buckets: a step's rows (decodes and prompt chunks), the LM head's
# the operations that multiply a weight (every candidate kernel of worker/quant/kernels.py)
MATMULS = ("mm", "addmm", "linear", "matmul", "mkldnn", "int8pack", "int4pack", "dyn_quant", "bmm")


def is_matmul(name: str) -> bool:
    """Whether a profiler event named ``name`` is a weight's matmul (aten::mm, oneDNN's linear, ...)."""
    return any(m in name for m in MATMULS) and "scaled_dot_product" not in name


def load(dtype: str, quantization: str, deterministic: bool = False) -> ModelRunner:
    """The embedded model on CPU with a cache for one sequence, as a runner: its kernels tuned for one
    row, or with ``deterministic`` as a default worker tunes them (one row-invariant kernel per weight
    over the buckets of :data:`SERVED_ROWS`)."""
    path = str(resolve_model("smollm2-135m-instruct", progress=False, quantization=quantization))
    config = model_mod.load_config(path)
    dt = model_mod.DTYPES[dtype]
    rows = SERVED_ROWS if deterministic else (1, 1)
    plan = model_mod.plan_in_process(path, dtype, 2048, quantization, rows=rows, deterministic=deterministic)
    model = model_mod.load_model(plan)
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
    p.add_argument("--capture", action="store_true", help="profile the captured decode step")
    p.add_argument("--deterministic", action="store_true", help="the kernels a default (deterministic) worker runs")
    p.add_argument("--threads", type=int, default=1, help="torch's threads (a worker runs one per core)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runner = load(a.dtype, a.quantization, a.deterministic)
    cap = step_capture.build(runner.model, runner.cache, 1, enforce_eager=False)
    if a.capture:
        if cap.fused is None:
            raise SystemExit("the captured step is not available here (see the log)")
        runner.forward = captured_forward(cap)
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
    step_cpu = min(timed(runner, a.steps, a.context, time.thread_time) for _ in range(a.rounds * 4))
    mat_cpu = min(linears_alone(runner.model, a.steps, time.thread_time) for _ in range(a.rounds * 4))
    print(
        f"by CPU time: step {step_cpu * 1e3:.2f} ms, its linears alone {mat_cpu * 1e3:.2f} ms, "
        f"non-matmul share {1 - mat_cpu / step_cpu:.1%}"
    )
    if a.capture:
        step_cpu, bare = outside_matmuls(cap.fused, a.context, a.steps, a.rounds * 4)
        print(
            f"by CPU time, directly: the captured step {step_cpu * 1e3:.2f} ms, with every linear returning a "
            f"fixed output {bare * 1e3:.2f} ms: non-matmul share {bare / step_cpu:.1%}"
        )
    read = weights_read(runner.model, a.quantization)
    print(
        f"a step reads {read / 1e6:.0f} MB of weights: {read / mat_cpu / 1e9:.1f} GB/s by the linears alone, "
        f"{read / step_cpu / 1e9:.1f} GB/s over the step"
    )


def captured_forward(cap):
    """``ModelRunner.forward``'s signature over the captured step (decode rows only)."""
    from worker.step.decode import step_inputs

    def forward(ids, positions, decode, prefill, logit_rows, hidden_rows=None):
        if prefill:
            return ModelRunner.forward(cap_runner, ids, positions, decode, prefill, logit_rows)
        rows = [(t, n - 1, int(i)) for (t, n), i in zip(decode, ids.tolist(), strict=True)]
        return cap.fused.forward(*step_inputs(rows, cap.block_size))

    cap_runner = ModelRunner(cap.fused.model, cap.fused.cache, CPU)
    return forward


@torch.inference_mode()
def linears_alone(model, steps: int, clock) -> float:
    """Seconds per step of one batch-1 step's linears (each layer's four and the LM head), called
    alone on zero inputs of their shapes and dtypes, by ``clock``."""
    hidden, attn, inter = model.config.hidden_size, model.heads * model.head_dim, model.config.intermediate_size
    calls = []
    for layer in model.layers:
        for fn, k in ((layer.qkv, hidden), (layer.o, attn), (layer.gate_up, hidden), (layer.down, inter)):
            calls.append((fn, torch.zeros(1, k, dtype=model.dtype)))
    calls.append((model.lm_head, torch.zeros(1, model.config.hidden_size, dtype=model.dtype)))
    start = clock()
    for _ in range(steps):
        for fn, x in calls:
            fn(x)
    return (clock() - start) / steps


@torch.inference_mode()
def outside_matmuls(fused, context: int, steps: int, rounds: int) -> tuple[float, float]:
    """Seconds of this thread's CPU time per captured batch-1 decode step, and per the same step with
    every linear (the layers' four, the LM head) replaced by a function returning a tensor of its
    output's shape and dtype: what is left is the step without its matmuls (norms, RoPE, attention,
    SiLU·up, residual adds, the inputs, Python). Rounds of the two alternate and each takes its
    fastest, so a slow stretch of the machine does not fall on one of them only."""
    from worker.step.decode import step_inputs

    model, rows = fused.model, 1
    inputs = step_inputs([(list(range(-(-context // BLOCK))), context - 1, 1)], BLOCK)
    hidden, inter, attn = model.config.hidden_size, model.config.intermediate_size, model.heads * model.head_dim
    fixed = []
    for n1, qa, qkv, qb, oa, o, ob, n2, ga, gate_up, da, down, *rest in fused.layers(rows):
        outs = [
            fn(torch.zeros(rows, k, dtype=d))
            for fn, k, d in ((qkv, hidden, qa), (o, attn, oa), (gate_up, hidden, ga), (down, inter, da))
        ]
        q_, o_, g_, d_ = (lambda x, out=out: out for out in outs)
        fixed.append((n1, qa, q_, qb, oa, o_, ob, n2, ga, g_, da, d_, *rest))
    logits = model.head(torch.zeros(rows, hidden))

    def head(x):  # the final norm stays: it is not a matmul
        torch.nn.functional.rms_norm(x, (x.shape[-1],), model.norm, model.eps)
        return logits

    bare = copy.copy(fused)  # the same operators and cache over a copy of the model whose head is fixed
    bare.model = copy.copy(model)
    bare.model.head = head
    bare.layers = lambda n: fixed

    def one_round(step) -> float:
        start = time.thread_time()
        for _ in range(steps):
            step.forward(*inputs)
        return (time.thread_time() - start) / steps

    best_step = best_bare = float("inf")
    for _ in range(rounds):
        best_step = min(best_step, one_round(fused))
        best_bare = min(best_bare, one_round(bare))
    return best_step, best_bare


def weights_read(model, quantization: str) -> int:
    """Bytes of weights one step's linears read: their shapes in the compute dtype for a float model,
    else every weight the model holds (its quantized forms)."""
    if quantization != "none":
        return model.linears.weight_bytes
    c, layers = model.config, len(model.layers)
    attn, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    per_layer = c.hidden_size * (attn + 2 * kv) + attn * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return (layers * per_layer + c.vocab_size * c.hidden_size) * model.dtype.itemsize


def timed(runner: ModelRunner, steps: int, context: int, clock=time.perf_counter) -> float:
    """Seconds per decode step over ``steps`` steps, by ``clock``."""
    start = clock()
    for _ in range(steps):
        decode_step(runner, context)
    return (clock() - start) / steps


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
