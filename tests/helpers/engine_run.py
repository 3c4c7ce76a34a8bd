"""The engine in process for the integration tests: the embedded model in float32 on CPU
(:func:`load_float32`, behind the session's ``loaded`` fixture, ``tests/helpers/fixtures.py``: one
load for every module that drives it) and :class:`Run`, one :class:`Engine` with its own KV cache and
scheduler recording every message it returns."""

from __future__ import annotations

import torch

from launcher.bench.dtype_match import PROMPTS
from launcher.models import resolve_model
from worker import model as model_mod
from worker.attention import KVCache
from worker.blocks import BlockManager
from worker.contract.protocol import Failed, Generate, SamplingParams, Tokens
from worker.cpu_share import ThreadGovernor
from worker.engine import Engine
from worker.runner import ModelRunner
from worker.scheduler import PrefillShares, Scheduler
from worker.step_cost import StepCost

QUESTIONS = PROMPTS[:8]  # the dtype bench's first eight: short chat questions
CPU = torch.device("cpu")
BLOCK = 16


def chat_ids(tok, content: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


class Run:
    """Drives one :class:`Engine` (its own KV cache and scheduler) and records every message, in order."""

    def __init__(
        self,
        loaded,
        num_blocks: int = 1024,
        max_num_seqs: int = 8,
        prefill: int = 32,
        idle: int = 512,
        max_waiting: int = 64,
        shares: PrefillShares | None = None,
        cost: StepCost | None = None,
        governor: ThreadGovernor | None = None,
    ):
        model, tok, config, eos = loaded
        self.events: list = []
        layers, kv_heads, head_dim = model_mod.kv_shape(config)
        self.cache = KVCache(layers, num_blocks, BLOCK, kv_heads, head_dim, model.dtype, CPU)
        self.scheduler = Scheduler(
            BlockManager(num_blocks, BLOCK), max_num_seqs, max_waiting, prefill, idle_prefill_tokens=idle, shares=shares
        )
        self.scheduler.set_prefill_budget(prefill, idle, cost)
        self.engine = Engine(
            ModelRunner(model, self.cache, CPU),
            tok,
            self.scheduler,
            2048,
            CPU,
            config.vocab_size,
            eos,
            governor,
        )
        self.max_blocks_used = 0

    def submit(
        self,
        rid: str,
        prompt: list[int],
        output: list[int] | None = None,
        priority: int = 0,
        flex: bool = False,
        **params,
    ) -> None:
        params.setdefault("max_tokens", 16)
        params.setdefault("temperature", 0.0)
        gen = Generate(
            request_id=rid,
            prompt_token_ids=prompt,
            params=SamplingParams(**params),
            output_token_ids=output or [],
            priority=priority,
            flex=flex,
        )
        self.events += self.engine.submit(gen)

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.engine.has_work:
                self.events += self.engine.step()
                self.engine.idle()  # the serving loop's turn hook, as worker.main.serve calls it
                blocks = self.scheduler.blocks
                self.max_blocks_used = max(self.max_blocks_used, blocks.num_blocks - blocks.num_free)

    def drain(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if not self.engine.has_work:
                return
            self.steps(1)
        raise AssertionError("engine did not drain")

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events if isinstance(e, Tokens) and e.request_id == rid for t in e.token_ids]

    def text(self, rid: str) -> str:
        return "".join(e.text_delta for e in self.events if isinstance(e, Tokens) and e.request_id == rid)

    def finish(self, rid: str) -> Tokens:
        return next(e for e in self.events if isinstance(e, Tokens) and e.request_id == rid and e.finish_reason)

    def failed(self) -> list[tuple[str, int, str]]:
        return [(e.request_id, e.code, e.message) for e in self.events if isinstance(e, Failed)]


def load_float32() -> tuple:
    """``(model, tokenizer, config, eos ids)`` of the embedded default in float32 on CPU, torch on
    one thread (steady timing whatever else the machine runs)."""
    torch.set_num_threads(1)
    path = str(resolve_model("smollm2-135m-instruct", progress=False))
    config = model_mod.load_config(path)
    tok = model_mod.load_tokenizer(path)
    model = model_mod.load_model(model_mod.plan_in_process(path, torch.float32, 2048))
    return model, tok, config, model_mod.eos_ids(path, config, tok)
