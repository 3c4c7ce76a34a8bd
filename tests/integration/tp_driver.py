"""One rank of a tensor-parallel replica without ZeroMQ, for tests/integration/test_tensor_parallel.py.

``python -m tests.integration.tp_driver --rank R --world-size N --dist-init tcp://127.0.0.1:PORT
--model-path DIR --script SCRIPT.json --out OUT.json``: every rank builds its part of the replica
through the worker's own code (:func:`worker.main.join_group`, :func:`worker.replica.build_engine`
on rank 0, :func:`worker.main.run_follower_process` on the others). Rank 0 then warms up and runs
the script through the real :class:`~worker.engine.Engine`: ``{"submit": rid, "text": ...,
"params": {...}}`` (a chat prompt), ``{"steps": n}``, ``{"idle": seconds}`` (the serving loop's
idle path: keep-alives only) and ``{"mark": path}`` (writes the file), then drains, stops the other
ranks and writes ``{"tokens": {rid: [ids]}, "first_step": {rid: n}, "last_step": {rid: n}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from worker.contract.args import WorkerArgs
from worker.contract.protocol import Failed, Generate, SamplingParams, Tokens
from worker.contract.settings import WorkerSettings
from worker.main import join_group, run_follower_process
from worker.model import plan_load
from worker.replica import build_engine, warm_up
from worker.tp import PEER_LOST_EXIT_CODE, PeerLost


def config(args) -> WorkerSettings:
    prefill = args.max_prefill_tokens if args.max_prefill_tokens == "auto" else int(args.max_prefill_tokens)
    return WorkerSettings.model_validate(
        {
            "model": {"dtype": args.dtype, "max_model_len": 1024, "random_init": args.random_init},
            "workers": {
                "devices": "cpu",
                "kv_cache_gib": 0.05,
                "max_prefill_tokens": prefill,
                "stall_timeout_s": args.stall_timeout_s,
            },
        }
    )


class Rank0:
    """Rank 0's engine, driven by a script, with each request's first and last token step."""

    def __init__(self, cfg: WorkerSettings, args):
        self.events: list = []
        self.group = join_group(cfg, 0, args.world_size, args.dist_init, "cpu") if args.world_size > 1 else None
        plan = plan_load(cfg, args.model_path, "cpu", 1.0, 0, args.world_size)
        self.engine, self.budget = build_engine(cfg, plan, group=self.group)
        warm_up(self.engine)
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.step_s: list[float] = []  # the script's steps (not warm-up): for a look, not asserted

    def step(self) -> None:
        seen = len(self.events)
        start = time.perf_counter()
        self.events += self.engine.step()
        self.step_s.append(time.perf_counter() - start)
        for e in self.events[seen:]:
            if isinstance(e, Tokens):
                self.first.setdefault(e.request_id, self.engine.steps)
                self.last[e.request_id] = self.engine.steps

    def submit(self, rid: str, text: str, params: dict) -> None:
        tok = self.engine.tokenizer
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        self.events += self.engine.submit(
            Generate(request_id=rid, prompt_token_ids=ids, params=SamplingParams(**params))
        )

    def idle(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.engine.idle()
            time.sleep(0.05)

    def play(self, script: list[dict]) -> None:
        for op in script:
            if "submit" in op:
                self.submit(op["submit"], op["text"], op["params"])
            elif "idle" in op:
                self.idle(op["idle"])
            elif "mark" in op:
                Path(op["mark"]).write_text("ready")
            else:
                for _ in range(op["steps"]):
                    if self.engine.has_work:
                        self.step()
        while self.engine.has_work:
            self.step()
        if self.group is not None:
            self.group.send_stop()

    def result(self) -> dict:
        tokens: dict[str, list[int]] = {}
        for e in self.events:
            if isinstance(e, Tokens):
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
        return {
            "tokens": tokens,
            "first_step": self.first,
            "last_step": self.last,
            "failed": [e.message for e in self.events if isinstance(e, Failed)],
            "peak_running": self.engine.scheduler.peak_running,
            "kv_budget_tokens": self.budget,
            "max_prefill_tokens": self.engine.scheduler.max_prefill_tokens,
            "kv_heads_per_rank": self.engine.runner.cache.layers[0].shape[2],
            "median_step_s": sorted(self.step_s)[len(self.step_s) // 2] if self.step_s else None,
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--dist-init", default=None)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--script")
    ap.add_argument("--out")
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--max-prefill-tokens", default="32")
    ap.add_argument("--stall-timeout-s", type=float, default=30.0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = config(args)
    try:
        if args.rank > 0:
            rank = WorkerArgs(
                "", 0, "cpu", args.model_path, "", rank=args.rank, world_size=args.world_size, dist_init=args.dist_init
            )
            sys.exit(run_follower_process(cfg, rank))
        rank0 = Rank0(cfg, args)
        with open(args.script) as f:
            rank0.play(json.load(f))
        result = rank0.result()
    except PeerLost as exc:
        print(exc, file=sys.stderr)
        sys.exit(PEER_LOST_EXIT_CODE)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
