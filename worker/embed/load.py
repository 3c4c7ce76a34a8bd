"""Starting an embedding worker: load the model, size the batcher, warm up, say :class:`Ready`.

The step's token budget is :func:`worker.contract.embed_spec.step_tokens` (``workers.max_prefill_tokens``,
never below the longest input allowed; ``plan`` sizes with the same rule); the requests held at
once are ``workers.max_num_seqs + workers.max_waiting``, as for chat.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from worker.contract.embed_spec import read_spec, step_tokens
from worker.contract.load_plan import LoadPlan
from worker.contract.protocol import Embed, Ready
from worker.contract.settings import WorkerSettings
from worker.embed.batcher import Batcher
from worker.embed.engine import EmbedEngine
from worker.embed.model import Embedder
from worker.embed.threads import ThreadPlan, measure

log = logging.getLogger(__name__)


def build_embed_engine(cfg: WorkerSettings, plan: LoadPlan) -> EmbedEngine:
    """The engine of the model ``plan`` names, on its device in its dtype, warmed up."""
    from worker import model as model_mod

    device = model_mod.pick_device(plan.device)
    spec = read_spec(plan.model_path, plan.max_model_len)
    embedder = Embedder.load(plan.model_path, spec, device, model_mod.DTYPES[plan.dtype])
    w = cfg.workers
    budget = step_tokens(w.max_prefill_tokens, device.type == "cuda", spec.max_tokens)
    batcher = Batcher(budget, w.max_num_seqs + w.max_waiting, w.max_queue_wait_s)
    engine = EmbedEngine(embedder, batcher)
    warm_up(engine)  # first: the first forward pass pays for allocations and kernel set-up, not threads
    plan_threads(embedder)
    return engine


def plan_threads(embedder: Embedder) -> None:
    """On CPU, measure where a batch is worth all the worker's cores (:mod:`worker.embed.threads`)."""
    if embedder.threads is None:
        return
    cores = embedder.threads.cores
    started = time.perf_counter()
    try:
        embedder.threads = ThreadPlan(cores, measure(embedder.probe, cores))
    finally:
        torch.set_num_threads(cores)
    log.info(
        "torch threads per batch, measured in %.2fs: %s", time.perf_counter() - started, embedder.threads.describe()
    )


def warm_up(engine: EmbedEngine) -> None:
    """One short request through the real engine path, its answer discarded."""
    engine.submit(Embed(request_id="warm-up", inputs=[[min(101, engine.embedder.vocab_size - 1)] * 4]))
    while engine.has_work:
        engine.step()


def load_embedder(cfg: WorkerSettings, link, plan: LoadPlan, started: float):
    """The embedding worker's part of :func:`worker.main.load`, as ``plan`` says: ``(engine, Ready, None)``."""
    plan.check()
    engine = build_embed_engine(cfg, plan)
    spec = engine.embedder.spec
    log.info(
        "loaded %s for embeddings as %s on %s in %.1fs: %s pooling, %d dimensions, up to %d tokens per input, "
        "%d tokens per step",
        cfg.model.public_name,
        engine.embedder.dtype,
        engine.device,
        time.monotonic() - started,
        spec.pooling,
        spec.dim,
        spec.max_tokens,
        engine.batcher.token_budget,
    )
    ready = Ready(
        worker_id=link.worker_id,
        load_seconds=time.monotonic() - started,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        kv_budget_tokens=0,
        weight_bytes=engine.embedder.weight_bytes,
        kernels=engine.embedder.linears.report() if engine.embedder.linears is not None else [],
    )
    return engine, ready, None
