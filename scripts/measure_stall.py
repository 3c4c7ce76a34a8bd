"""How long running streams wait while a document is prefilled beside them, in engine steps, in
process: the bench's stall figure without the HTTP path, comparable on a shared machine.

Usage: ``PYTHONPATH=. python scripts/measure_stall.py [--dtype auto] [--quantization auto]
[--ratios 3,2.5] [--tokens 16] [--streams 4] [--doc-tokens 1500] [--repeats 2] [--cpu-clock]``. Loads the
default model as a worker does (:func:`worker.replica.build_engine`, which measures the step costs
and logs them), then for each policy runs a fresh scheduler over the loaded model: ``--streams``
chats decode, a ``--doc-tokens`` document (this repository's README) arrives, and every engine step
until its first token is timed (wall clock and the process's CPU time). Policies: ``tokens:N``, a
fixed budget of N prompt tokens a step beside decodes (the budget before step costs were measured
came out at its floor of 16 on the Zen 4 box), and ``cost:R``, the measured costs with a step
bounded by R decode steps. Prints per policy and repeat: the decode-only step's median, the chunk
steps' median, 95th percentile and maximum, max / decode median (the bench's "stall
longest/median"), and the document's prefill time and steps. The policies take turns, so a busy
moment of the machine does not fall on one of them only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from pathlib import Path

import torch

from launcher.bench.dtype_match import PROMPTS
from launcher.models import resolve_model
from worker.blocks import BlockManager
from worker.contract.protocol import Generate, SamplingParams, Tokens
from worker.contract.settings import WorkerSettings
from worker.engine import Engine
from worker.model import plan_load
from worker.replica import BLOCK_SIZE, build_engine, calibrate_step_cost, warm_up
from worker.scheduler import PrefillShares, Scheduler


def chat(tok, text: str) -> list[int]:
    templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(templated, add_special_tokens=False)["input_ids"]


def fresh(base: Engine, policy: str) -> Engine:
    """An engine over ``base``'s runner with an empty prefix cache and ``policy``'s prefill budget."""
    s = base.scheduler
    scheduler = Scheduler(
        BlockManager(s.blocks.num_blocks, BLOCK_SIZE),
        s.max_num_seqs,
        64,
        s.max_prefill_tokens,
        idle_prefill_tokens=s.idle_prefill_tokens,
        shares=PrefillShares(),
    )
    kind, value = policy.split(":")
    if kind == "tokens":
        scheduler.set_prefill_budget(int(value), s.idle_prefill_tokens)
    else:
        cost = dataclasses.replace(s.cost, ratio=float(value))
        scheduler.set_prefill_budget(s.max_prefill_tokens, s.idle_prefill_tokens, cost)
    return Engine(
        base.runner, base.tokenizer, scheduler, base.max_model_len, base.device, base.vocab_size, base.eos_ids
    )


def timed_step(engine: Engine, out: list) -> tuple[float, float, int]:
    """One engine step: (wall s, CPU s, prompt tokens it prefilled)."""
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    w, c = time.perf_counter(), time.process_time()
    out += engine.step()
    w, c = time.perf_counter() - w, time.process_time() - c
    engine.scheduler.schedule = schedule
    return w, c, sum(e - b for _, b, e in plans[0].prefill)


def scenario(base: Engine, policy: str, chats: list[list[int]], doc: list[int]) -> dict:
    """The streams decode, the document arrives; every step's times until its first token."""
    engine, out = fresh(base, policy), []
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    for i, ids in enumerate(chats):
        out += engine.submit(Generate(request_id=f"chat{i}", prompt_token_ids=ids, params=params))
    for _ in range(6):
        timed_step(engine, out)
    decode = [timed_step(engine, out) for _ in range(12)]
    out += engine.submit(Generate(request_id="doc", prompt_token_ids=doc, params=SamplingParams(max_tokens=4)))
    steps, began = [], time.perf_counter()
    while not any(isinstance(m, Tokens) and m.request_id == "doc" for m in out):
        steps.append(timed_step(engine, out))
    prefill_s = time.perf_counter() - began
    for rid in list(engine.by_id):
        engine.cancel(rid)
    chunks = [s for s in steps if s[2]]
    return {"decode": decode, "chunks": chunks, "prefill_s": prefill_s, "steps": len(steps)}


def report(policy: str, r: dict) -> str:
    dw = statistics.median(w for w, _, _ in r["decode"])
    dc = statistics.median(c for _, c, _ in r["decode"])
    cw = sorted(w for w, _, _ in r["chunks"])
    cc = sorted(c for _, c, _ in r["chunks"])
    p95 = cw[int(0.95 * (len(cw) - 1))]
    tokens = [n for _, _, n in r["chunks"]]
    return (
        f"{policy:>10} | decode {1e3 * dw:6.1f} ms (cpu {1e3 * dc:6.1f}) | chunk steps med {1e3 * statistics.median(cw):6.1f}"
        f" p95 {1e3 * p95:6.1f} max {1e3 * cw[-1]:6.1f} | max/decode {cw[-1] / dw:5.2f} p95/decode {p95 / dw:5.2f}"
        f" (cpu max/decode {cc[-1] / dc:5.2f} p95/decode {cc[int(0.95 * (len(cc) - 1))] / dc:5.2f}) | chunks {tokens[0]}..{tokens[-1]} tokens | document prefill "
        f"{r['prefill_s']:5.2f} s (cpu {sum(cc):5.2f} s) in {r['steps']} steps"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--ratios", default="3", help="step bounds to compare, in decode steps (the default: 3)")
    ap.add_argument("--tokens", default="16", help="fixed token budgets to compare (empty: none)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="a busy machine: one thread, the step costs measured again by its CPU clock (compare the cpu figures)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    model = {"dtype": args.dtype, "quantization": args.quantization, "max_model_len": args.max_model_len}
    cfg = WorkerSettings.model_validate({"model": model})
    path = str(resolve_model(cfg.model.name, progress=False, quantization=cfg.model.quantization))
    if args.cpu_clock:
        torch.set_num_threads(1)
    base, _ = build_engine(cfg, plan_load(cfg, path, "cpu"))
    warm_up(base)
    if args.cpu_clock:
        s = base.scheduler
        cost = calibrate_step_cost(
            base.runner, s.idle_prefill_tokens, base.max_model_len, s.max_num_seqs, time.thread_time
        )
        s.set_prefill_budget(s.max_prefill_tokens, s.idle_prefill_tokens, cost)
    tok = base.tokenizer
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = tok(readme, add_special_tokens=False)["input_ids"][: args.doc_tokens - 40]
    doc = chat(tok, "Summarise this document.\n\n" + tok.decode(body))
    chats = [chat(tok, q) for q in PROMPTS[: args.streams]]
    policies = [f"tokens:{t}" for t in args.tokens.split(",") if t] + [f"cost:{r}" for r in args.ratios.split(",") if r]
    print(f"document {len(doc)} tokens beside {len(chats)} streams; {base.scheduler.cost}", flush=True)  # noqa: T201
    for _ in range(args.repeats):
        for policy in policies:
            print(report(policy, scenario(base, policy, chats, doc)), flush=True)  # noqa: T201


if __name__ == "__main__":
    main()
