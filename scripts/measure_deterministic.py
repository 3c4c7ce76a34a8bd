"""What ``workers.deterministic`` costs: the embedded model in process, with and without, per precision.

Usage: ``PYTHONPATH=. python scripts/measure_deterministic.py [--precisions default,int8,float32]
[--rows 8] [--context 200] [--prompt 512] [--steps 16] [--rounds 5]``.

Per precision (``default``: the Q4_1 file in bfloat16 where the CPU has avx512_bf16, else float32;
``int8``: ``quantization: int8`` in that dtype; ``float32``: the float checkpoint) it loads the model
twice (deterministic off, then on; each with its own kernel table) and prints, for each:

* a closed-loop decode step: ``--rows`` sequences of about ``--context`` tokens each decoded
  together, through the captured step (the serving path of a decode-only step);
* the prefill of one ``--prompt``-token prompt in one chunk (the eager forward).

Each figure is this thread's CPU time (``time.thread_time``) with torch on one thread, the fastest of
``--rounds`` rounds: on a shared machine wall time counts the other processes' turns, CPU time does
not, and other processes only add time, so the fastest round is the one they disturbed least. The
ratio on/off of the decode step is the closed-loop throughput cost (sampling and transport, the same
in both modes, left out: the printed cost is an upper bound).
"""

from __future__ import annotations

import argparse
import time

import torch

from launcher.models import resolve_model
from worker import model as model_mod
from worker.attention import KVCache
from worker.runner import ModelRunner
from worker.step import capture as step_capture

CPU = torch.device("cpu")
BLOCK = 16


def precision(name: str) -> tuple[str, torch.dtype]:
    """``(quantization, dtype)`` of a precision's name (module docstring)."""
    bf16 = "avx512_bf16" in open("/proc/cpuinfo").read()
    narrow = torch.bfloat16 if bf16 else torch.float32
    return {"default": ("auto", narrow), "int8": ("int8", narrow), "float32": ("none", torch.float32)}[name]


def load(name: str, deterministic: bool, rows: int, blocks: int) -> tuple[ModelRunner, object]:
    """The runner (model, cache of ``blocks`` blocks) and its captured step (or None)."""
    quantization, dt = precision(name)
    path = str(resolve_model("smollm2-135m-instruct", progress=False, quantization=quantization))
    config = model_mod.load_config(path)
    plan = model_mod.plan_in_process(path, dt, 2048, quantization, rows=(rows, rows), deterministic=deterministic)
    model = model_mod.load_model(plan)
    layers, kv_heads, head_dim = model_mod.kv_shape(config)
    cache = KVCache(layers, blocks, BLOCK, kv_heads, head_dim, dt, CPU)
    return ModelRunner(model, cache, CPU), step_capture.build(model, cache, rows, False)


def best(fn, steps: int, rounds: int) -> float:
    """The fastest of ``rounds`` rounds of ``steps`` calls, in thread CPU seconds per call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(steps):
            fn()
        times.append((time.thread_time() - start) / steps)
    return min(times)


def measure(name: str, deterministic: bool, args) -> tuple[float, float, str]:
    """(decode step, prefill) seconds and how the decode step ran."""
    per_seq = -(-max(args.context + args.steps + 2, args.prompt) // BLOCK)
    runner, cap = load(name, deterministic, args.rows, per_seq * (args.rows + 1))
    prompt = torch.randint(100, 20000, (args.prompt,))
    table = list(range(per_seq * args.rows, per_seq * (args.rows + 1)))
    last = torch.tensor([args.prompt - 1])
    prefill = best(lambda: runner.forward(prompt, torch.arange(args.prompt), [], [(table, 0, args.prompt)], last), 1, 3)
    rows = [(list(range(i * per_seq, (i + 1) * per_seq)), args.context + i, 1 + i) for i in range(args.rows)]
    for table_i, _, _ in rows:  # each sequence's cache written by a prefill, as serving does
        ids = torch.randint(100, 20000, (args.context + args.rows,))
        n = len(ids)
        runner.forward(ids, torch.arange(n), [], [(table_i, 0, n)], torch.tensor([n - 1]))
    fused = cap.fused if cap is not None else None
    if fused is not None:
        step, how = (lambda: fused.forward_rows(rows)), "captured"
    else:
        ids = torch.tensor([t for _, _, t in rows])
        pos = torch.tensor([p for _, p, _ in rows])
        decode = [(t, p + 1) for t, p, _ in rows]
        every = torch.arange(len(rows))
        step, how = (lambda: runner.forward(ids, pos, decode, [], every)), "eager"
    return best(step, args.steps, args.rounds), prefill, how


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", default="default,int8,float32")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'precision':10} {'deterministic':>13} {'decode ms':>10} {'(path)':>9} {'prefill ms':>11}")
    for name in args.precisions.split(","):
        got = {}
        for det in (False, True):
            got[det] = measure(name, det, args)
            d, pf, how = got[det]
            print(f"{name:10} {det!s:>13} {d * 1e3:10.2f} {how:>9} {pf * 1e3:11.1f}")
        (off, poff, _), (on, pon, _) = got[False], got[True]
        print(f"{name:10} {'cost':>13} {on / off:9.3f}x {'':>9} {pon / poff:10.3f}x   (on / off, CPU time)")


if __name__ == "__main__":
    main()
