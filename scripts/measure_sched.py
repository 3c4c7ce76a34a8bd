"""How the scheduler's short-before-long settings trade a question's wait against a document's.

Usage: ``PYTHONPATH=. python scripts/measure_sched.py [--threads 2] [--doc-tokens 1400]``. Loads the
default deployment's model as a worker does (:func:`worker.replica.build_engine`: the GGUF file as
stored, the CPU's calibrated prefill budget) and, for each setting, runs in process:

* **question beside a document**: 4 chats decode, a ~``--doc-tokens`` document (this repository's
  README) is being prefilled and a second one waits; a short question arrives. Its time to first
  token, in steps and seconds.
* **document under questions**: the same document's time to first token while a short question
  arrives every other step (the price of letting questions go first).

``threshold inf`` is the old policy (every prompt short: prefills in arrival order, first come
first served). Prints one row per setting; steps are firm, seconds are what a shared machine gave.
"""

from __future__ import annotations

import argparse
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
from worker.replica import BLOCK_SIZE, build_engine, warm_up
from worker.scheduler import PrefillShares, Scheduler

SETTINGS = "inf:1:0.25 128:1:0.25 256:1:0.125 256:1:0.25 256:1:0.5 512:1:0.25 256:2:0.25"


class StepCounter:
    """Stands in for the model runner with ``--steps-only``: the logits of each sequence to sample
    are zeros (every request here ignores eos, so which token comes does not matter). Steps to a
    first token depend on the scheduler alone, not on the model."""

    def __init__(self, runner):
        self.runner = runner
        self.oom_recoverable = True

    def run(self, plan):
        rows = len(plan.decode) + sum(1 for seq, _, end in plan.prefill if end == seq.num_tokens)
        return torch.zeros(rows, self.runner.model.config.vocab_size)

    def idle(self) -> None:
        pass


def chat(tok, text: str) -> list[int]:
    templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(templated, add_special_tokens=False)["input_ids"]


class Bench:
    """A fresh engine per setting over one loaded runner; counts steps and seconds to first tokens."""

    def __init__(self, base: Engine, steps_only: bool):
        self.base = base
        self.runner = StepCounter(base.runner) if steps_only else base.runner
        self.events: list = []

    def engine(self, threshold: float, max_long: int, share: float) -> Engine:
        b = self.base
        s = b.scheduler
        shares = PrefillShares(int(min(threshold, 10**9)), max_long, share)
        scheduler = Scheduler(
            BlockManager(s.blocks.num_blocks, BLOCK_SIZE),
            16,
            64,
            s.max_prefill_tokens,
            idle_prefill_tokens=s.idle_prefill_tokens,
            shares=shares,
        )
        return Engine(self.runner, b.tokenizer, scheduler, b.max_model_len, b.device, b.vocab_size, b.eos_ids)

    def chatting(self, setting, chats: list[list[int]]) -> Engine:
        """A fresh engine with ``setting`` whose ``chats`` are decoding."""
        engine = self.engine(*setting)
        for i, ids in enumerate(chats):
            self.submit(engine, f"chat{i}", ids, 400)
        for _ in range(3):
            self.events += engine.step()
        return engine

    def submit(self, engine: Engine, rid: str, ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.events += engine.submit(Generate(request_id=rid, prompt_token_ids=ids, params=params))

    def until_first(self, engine: Engine, rid: str, every=None) -> tuple[int, float]:
        """Steps and seconds until ``rid``'s first token; ``every(step)`` may submit more meanwhile."""
        start, steps = time.perf_counter(), 0
        while not any(isinstance(e, Tokens) and e.request_id == rid for e in self.events):
            if every:
                every(steps)
            self.events += engine.step()
            steps += 1
        return steps, time.perf_counter() - start


def question_beside_document(bench: Bench, setting, doc: list[int], chats: list[list[int]]) -> tuple[int, float]:
    engine = bench.chatting(setting, chats)
    bench.submit(engine, "doc1", doc, 8)
    bench.submit(engine, "doc2", [t + 1 for t in doc], 8)  # another document, not a prefix hit
    for _ in range(4):  # doc1 is part-way through its prompt
        bench.events += engine.step()
    bench.submit(engine, "question", chat(bench.base.tokenizer, PROMPTS[5]), 8)
    return bench.until_first(engine, "question")


def document_under_questions(bench: Bench, setting, doc: list[int], chats: list[list[int]]) -> tuple[int, float]:
    engine = bench.chatting(setting, chats)
    bench.submit(engine, "doc", doc, 8)

    def question(step: int) -> None:
        if step % 2 == 0:
            bench.submit(engine, f"q{step}", chats[step // 2 % len(chats)], 4)

    return bench.until_first(engine, "doc", question)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-tokens", type=int, default=1400)
    ap.add_argument("--settings", default=SETTINGS, help="threshold:max_long:share ... (threshold inf: arrival order)")
    ap.add_argument("--steps-only", action="store_true", help="count steps without running the model")
    ap.add_argument("--budgets", default="", help="prefill budgets beside decodes to try (default: the calibrated one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = WorkerSettings()
    path = str(resolve_model(cfg.model.name, progress=False, quantization=cfg.model.quantization))
    base, _ = build_engine(cfg, plan_load(cfg, path, "cpu"))
    warm_up(base)
    tok = base.tokenizer
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = tok(readme, add_special_tokens=False)["input_ids"][: args.doc_tokens - 40]
    doc = chat(tok, "Summarise this document.\n\n" + tok.decode(body))
    chats = [chat(tok, q) for q in PROMPTS[:4]]
    s = base.scheduler
    print(f"budget {s.max_prefill_tokens} tokens beside decodes, {s.idle_prefill_tokens} alone; document {len(doc)}")
    print(
        "threshold max_long share | question TTFT steps s | document TTFT steps s (questions every 2nd step)",
        flush=True,
    )
    for budget in [int(b) for b in args.budgets.split(",") if b] or [s.max_prefill_tokens]:
        s.set_prefill_budget(budget, 4 * budget)
        for text in args.settings.split():
            t, m, sh = text.split(":")
            setting = (float(t), int(m), float(sh))
            q_steps, q_s = question_beside_document(Bench(base, args.steps_only), setting, doc, chats)
            d_steps, d_s = document_under_questions(Bench(base, args.steps_only), setting, doc, chats)
            row = f"{budget:>6} {t:>9} {m:>8} {sh:>5} | {q_steps:>14} {q_s:6.2f} | {d_steps:>15} {d_s:6.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
