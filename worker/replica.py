"""Assembling one replica's engine: load the model, size its KV cache and allocate it once, choose
the prefill budget, warm it up.

On GPU the KV cache is sized after a warm-up pass at the largest prefill step, whose activation
peak the budget rule (:mod:`worker.contract.budget`) subtracts. On CPU its size is ``kv_cache_gib``, and
``max_prefill_tokens: auto`` is measured here (:func:`calibrate_prefill_tokens`).

A tensor-parallel replica runs :func:`load_shard` on every rank (each sizes its KV share from its
own GPU, or ``kv_cache_gib`` per rank on CPU; all take the smallest block count), then rank 0
builds the engine (:func:`build_engine`) and the others a follower (:func:`build_follower`).
Calibration and warm-up run on rank 0 through its runner, which announces each step to the other
ranks, so they follow without being told what the steps are for.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from worker import gpus as worker_gpus
from worker import grammar
from worker import model as model_mod
from worker.attention import KVCache
from worker.blocks import BlockManager, BlockTable
from worker.contract.protocol import Generate, SamplingParams
from worker.contract.settings import WorkerSettings
from worker.contract.units import GiB
from worker.engine import Engine
from worker.quant import autotune
from worker.runner import ModelRunner
from worker.scheduler import PrefillShares, Scheduler, StepPlan
from worker.step import capture

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # tokens per KV block: the prefix cache's granularity (vLLM's default)


class Shard:
    """What every rank of a replica holds alike (all of it, with one rank): the model (its shard),
    its KV cache (its KV heads), and the facts the engine is assembled from."""

    def __init__(self, config, device, dtype, model, cache: KVCache, num_blocks: int, budgets: tuple[int, int]):
        self.config, self.device, self.dtype, self.model, self.cache = config, device, dtype, model, cache
        self.num_blocks = num_blocks
        self.prefill_tokens, self.idle_prefill_tokens = budgets

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def load_shard(
    cfg: WorkerSettings, model_path: str, device_kind: str, share: float, group=None, kernel_table: Path | None = None
) -> Shard:
    """Load the model (this rank's shard of it with a tensor-parallel ``group``), size the KV cache
    (after measuring a prefill's activation peak on GPU) and allocate it once. Every rank runs this
    in the same order: the peak measurement's forward is collective, and the block count is the
    minimum over the ranks (each sizes its own from its own GPU, or from ``kv_cache_gib`` for its
    KV share on CPU). ``kernel_table``: the file of the kernel table shared with the other replicas
    (:func:`worker.quant.autotune.load_or_measure`; None: this replica measures its own).
    Raises ``worker.gpus.KvTooSmall`` when not one ``max_model_len`` sequence fits."""
    w = cfg.workers
    world = group.world if group is not None else 1
    device = model_mod.pick_device(device_kind)
    on_gpu = device.type == "cuda"
    if on_gpu:
        worker_gpus.apply_memory_fraction(w.gpu_memory_utilization, share)
    dtype = model_mod.resolve_dtype(cfg.model.dtype, device)
    config = model_mod.load_config(model_path)
    split = (
        worker_gpus.max_memory(share, w.gpu_memory_utilization) if on_gpu and torch.cuda.device_count() > 1 else None
    )
    prefill, idle = w.prefill_budgets(on_gpu)
    shared = autotune.load_or_measure(kernel_table) if kernel_table is not None else contextlib.nullcontext()
    with shared as table:  # another replica measuring the shared table: wait for it, then read it
        model = model_mod.load_model(
            model_path,
            config,
            device,
            dtype,
            cfg.model.max_model_len,
            random_init=cfg.model.random_init,
            max_memory=split,
            tp=group,
            quantization=cfg.model.quantization,
            rows=(w.max_num_seqs + idle, w.max_num_seqs),  # a step's most rows; the LM head's (one per sequence)
            deterministic=w.deterministic,
            shared=table,
        )
    per_token = model_mod.kv_bytes_per_token(config, dtype, world)
    layers, kv_heads, head_dim = model_mod.kv_shape(config, world)
    devices = model_mod.layer_devices(model, device)
    if on_gpu:
        if group is not None:
            group.barrier()  # every rank loaded: the collective forward below starts together
        worker_gpus.reset_peaks()
        measure_prefill_peak(model, devices, min(idle, cfg.model.max_model_len), BLOCK_SIZE, dtype, device, world)
        fractions = {d.index: devices.count(d) / len(devices) for d in set(devices)}
        budget = worker_gpus.kv_budget_after_warmup(
            per_token, fractions, w.gpu_memory_utilization, share, cfg.model.max_model_len, block_tokens=BLOCK_SIZE
        )
        num_blocks = budget.tokens // BLOCK_SIZE
    else:
        num_blocks = max(1, int(w.kv_cache_gib * GiB) // (per_token * BLOCK_SIZE))
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    cache = KVCache(layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, devices)
    return Shard(config, device, dtype, model, cache, num_blocks, (prefill, idle))


def build_engine(
    cfg: WorkerSettings, model_path: str, device_kind: str, share: float, group=None, kernel_table: Path | None = None
):
    """Load the replica (:func:`load_shard`, reading or writing ``kernel_table``) and assemble the engine; with a tensor-parallel
    ``group`` this is rank 0, whose runner announces every step (calibration included) to the
    other ranks. Returns ``(engine, kv_budget_tokens)``.
    Raises ``worker.gpus.KvTooSmall`` when not one ``max_model_len`` sequence fits."""
    w = cfg.workers
    shard = load_shard(cfg, model_path, device_kind, share, group, kernel_table)
    config, device, num_blocks = shard.config, shard.device, shard.num_blocks
    tokenizer = model_mod.load_tokenizer(model_path)
    idle = shard.idle_prefill_tokens
    scheduler = Scheduler(
        BlockManager(num_blocks, BLOCK_SIZE),
        w.max_num_seqs,
        w.max_waiting,
        shard.prefill_tokens,
        idle_prefill_tokens=idle,
        max_queue_wait_s=w.max_queue_wait_s,
        shares=PrefillShares(w.long_prefill_token_threshold, w.max_long_partial_prefills, w.long_prefill_share),
    )
    step = capture.build(shard.model, shard.cache, w.max_num_seqs, w.enforce_eager, group, cfg.model.max_model_len)
    engine = Engine(
        ModelRunner(shard.model, shard.cache, device, group=group, capture=step),
        tokenizer,
        scheduler,
        cfg.model.max_model_len,
        device,
        config.vocab_size,
        model_mod.eos_ids(model_path, config, tokenizer),
    )
    grammar.configure(tokenizer, config.vocab_size, engine.eos_ids)  # compiles on its own thread, cached
    if w.max_prefill_tokens == "auto" and not shard.on_gpu:
        chunk = calibrate_prefill_tokens(engine.runner, idle, cfg.model.max_model_len)
        scheduler.set_prefill_budget(chunk, min(idle, IDLE_CHUNKS * chunk))
        log.info(
            "prefill budget %d tokens per step beside decodes (a step within %gx a decode step), %d alone",
            scheduler.max_prefill_tokens,
            STEP_RATIO,
            scheduler.idle_prefill_tokens,
        )
    return engine, num_blocks * BLOCK_SIZE


def build_follower(cfg: WorkerSettings, model_path: str, device_kind: str, share: float, group) -> ModelRunner:
    """A tensor-parallel rank other than 0: its shard and KV share (:func:`load_shard`), as a runner
    for :func:`worker.tp.follow`. No tokenizer, scheduler or sampler: rank 0 has those."""
    shard = load_shard(cfg, model_path, device_kind, share, group)
    return ModelRunner(shard.model, shard.cache, shard.device)


class _Scratch:
    """Just enough of a Sequence for the runner: ``computed`` of ``num_tokens`` zeros in blocks
    ``first_block…``. Warm-up and calibration passes write only blocks no request holds yet."""

    def __init__(self, num_tokens: int, computed: int, first_block: int, block_size: int):
        self.table = BlockTable(blocks=list(range(first_block, first_block + -(-num_tokens // block_size))))
        self.num_tokens, self.computed = num_tokens, computed

    def tokens(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


def measure_prefill_peak(model, devices, tokens: int, block_size: int, dtype, device, world: int = 1) -> None:
    """One forward pass of ``tokens`` prompt tokens over a scratch cache, so the allocator's peak
    (read by ``worker.gpus.kv_budget_after_warmup``) includes the largest step's activations
    (nano-vllm's ``warmup_model`` before ``allocate_kv_cache``). The scratch cache is freed.
    With ``world`` tensor-parallel ranks every rank runs it at once (its sums are collective)."""
    layers, kv_heads, head_dim = model_mod.kv_shape(model.config, world)
    scratch = KVCache(layers, -(-tokens // block_size), block_size, kv_heads, head_dim, dtype, devices)
    ModelRunner(model, scratch, device).run(StepPlan(prefill=[(_Scratch(tokens, 0, 0, block_size), 0, tokens)]))
    del scratch
    torch.cuda.empty_cache()


STEP_RATIO = 2.0  # a step that prefills beside decodes may take this many decode steps
CALIBRATION_ROWS = 4  # decoding sequences in the calibration steps
# With nothing decoding, a step prefills this many calibrated chunks: enough for a burst of short
# prompts to share the weight reads, few enough that the first of them do not wait for the last.
IDLE_CHUNKS = 4
CALIBRATION_CONTEXT = 256  # their context, tokens


def calibrate_prefill_tokens(runner: ModelRunner, most: int, max_model_len: int) -> int:
    """The CPU's ``max_prefill_tokens: auto``: the largest chunk of 16, 32, … ``most`` tokens for
    which a step decoding a few sequences plus that chunk takes at most ``STEP_RATIO`` times the
    decode step alone (best of two timed passes each). On CPU a prefill is compute-bound, so this
    depends on the model, its dtype and the cores; measured, not guessed. Positions stay below
    ``max_model_len`` (the RoPE tables' length)."""
    bs = runner.cache.block_size
    context = min(CALIBRATION_CONTEXT, max_model_len // 2)
    most = min(most, max_model_len - context)
    per_seq = -(-(context + most) // bs)
    if (CALIBRATION_ROWS + 1) * per_seq > runner.cache.num_blocks or most < 16:
        return 16
    decode = [_Scratch(context, context - 1, i * per_seq, bs) for i in range(CALIBRATION_ROWS)]

    def timed(prefill: list) -> float:
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            runner.run(StepPlan(decode=decode, prefill=prefill))
            best = min(best, time.perf_counter() - start)
        return best

    base = timed([])
    chosen, chunk = 16, 16
    while chunk <= most:
        doc = _Scratch(context + chunk, context, CALIBRATION_ROWS * per_seq, bs)
        if timed([(doc, context, context + chunk)]) > STEP_RATIO * base:
            break
        chosen, chunk = chunk, chunk * 2
    return chosen


def warm_up(engine: Engine) -> None:
    """One short generation through the real engine path, its messages discarded."""
    try:
        ids = engine.tokenizer("Hello", add_special_tokens=True)["input_ids"] or [0]
        engine.submit(
            Generate(request_id="warm-up", prompt_token_ids=ids, params=SamplingParams(max_tokens=4, temperature=0))
        )
        while engine.has_work:
            engine.step()
    finally:
        engine.scheduler.blocks.reset_prefix_cache()
