"""Assembling one replica's engine: load the model as its load plan says
(:class:`worker.contract.load_plan.LoadPlan`), size its KV cache and allocate it once, choose the
prefill budget, warm it up.

On GPU the KV cache is sized after a warm-up pass at the largest prefill step, whose activation
peak the budget rule (:mod:`worker.contract.budget`) subtracts. On CPU its size is ``kv_cache_gib``, and
``max_prefill_tokens: auto`` is measured here (:func:`calibrate_step_cost`) at a model's first start
on the machine, and read at the next ones (:mod:`worker.start_cache`).

A tensor-parallel replica runs :func:`load_shard` on every rank (each sizes its KV share from its
own GPU, or ``kv_cache_gib`` per rank on CPU; all take the smallest block count), then rank 0
builds the engine (:func:`build_engine`) and the others a follower (:func:`build_follower`).
Calibration and warm-up run on rank 0 through its runner, which announces each step to the other
ranks, so they follow without being told what the steps are for.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path

import torch

from worker import gpus as worker_gpus
from worker import grammar, start_cache
from worker import model as model_mod
from worker.attention import KVCache
from worker.blocks import BlockManager, BlockTable
from worker.contract.load_plan import LoadPlan
from worker.contract.protocol import Generate, SamplingParams
from worker.contract.settings import WorkerSettings
from worker.contract.units import GiB
from worker.cpu_share import governor_for
from worker.engine import Engine
from worker.quant import autotune
from worker.runner import ModelRunner
from worker.scheduler import PrefillShares, Scheduler, StepPlan
from worker.step import capture
from worker.step_cost import StepCost

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


def load_shard(cfg: WorkerSettings, plan: LoadPlan, group=None, kernel_table: Path | None = None) -> Shard:
    """Load the model as ``plan`` says (this rank's shard of it with a tensor-parallel ``group``), size the KV cache
    (after measuring a prefill's activation peak on GPU) and allocate it once. Every rank runs this
    in the same order: the peak measurement's forward is collective, and the block count is the
    minimum over the ranks (each sizes its own from its own GPU, or from ``kv_cache_gib`` for its
    KV share on CPU). ``kernel_table``: the file of the kernel table shared with the other replicas
    (:func:`worker.quant.autotune.load_or_measure`; None: this replica measures its own).
    Raises ``worker.gpus.KvTooSmall`` when not one ``max_model_len`` sequence fits."""
    w = cfg.workers
    world, device, on_gpu = plan.world, model_mod.pick_device(plan.device), plan.on_gpu
    if plan.memory_fraction is not None:
        worker_gpus.set_memory_fraction(plan.memory_fraction)
    dtype, config = model_mod.DTYPES[plan.dtype], plan.config
    prefill, idle = plan.prefill_budgets
    shared = autotune.load_or_measure(kernel_table) if kernel_table is not None else contextlib.nullcontext()
    with shared as table:  # another replica measuring the shared table: wait for it, then read it
        model = model_mod.load_model(plan, tp=group, shared=table)
    per_token = model_mod.kv_bytes_per_token(config, dtype, world)
    layers, kv_heads, head_dim = model_mod.kv_shape(config, world)
    devices = model_mod.layer_devices(model, device)
    if on_gpu:
        if group is not None:
            group.barrier()  # every rank loaded: the collective forward below starts together
        worker_gpus.reset_peaks()
        measure_prefill_peak(model, devices, min(idle, plan.max_model_len), BLOCK_SIZE, dtype, device, world)
        peaks = worker_gpus.transient_peaks()
        graphs = measure_graph_pool(model, devices, cfg, plan, group)
        if graphs:
            peaks[devices[0].index] = peaks.get(devices[0].index, 0) + graphs
            log.info("CUDA graphs' pool: %.2f GiB kept out of the KV budget", graphs / GiB)
        fractions = {d.index: devices.count(d) / len(devices) for d in set(devices)}
        budget = worker_gpus.kv_budget_after_warmup(
            per_token,
            fractions,
            w.gpu_memory_utilization,
            plan.share,
            plan.max_model_len,
            block_tokens=BLOCK_SIZE,
            activation_peak=peaks,
        )
        num_blocks = budget.tokens // BLOCK_SIZE
    else:
        num_blocks = max(1, int(w.kv_cache_gib * GiB) // (per_token * BLOCK_SIZE))
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    cache = KVCache(layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, devices)
    return Shard(config, device, dtype, model, cache, num_blocks, (prefill, idle))


def build_engine(cfg: WorkerSettings, plan: LoadPlan, group=None, kernel_table: Path | None = None):
    """Load the replica as ``plan`` says (:func:`load_shard`, reading or writing ``kernel_table``) and assemble the engine; with a tensor-parallel
    ``group`` this is rank 0, whose runner announces every step (calibration included) to the
    other ranks. Returns ``(engine, kv_budget_tokens)``.
    Raises ``worker.gpus.KvTooSmall`` when not one ``max_model_len`` sequence fits."""
    w = cfg.workers
    shard = load_shard(cfg, plan, group, kernel_table)
    config, device, num_blocks = shard.config, shard.device, shard.num_blocks
    tokenizer = model_mod.load_tokenizer(plan.model_path)
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
        model_mod.eos_ids(plan.model_path, config, tokenizer),
        governor_for(torch.get_num_threads(), w.adapt_threads, shard.on_gpu, group is not None),
    )
    grammar.configure(tokenizer, config.vocab_size, engine.eos_ids)  # compiles on its own thread, cached
    if w.max_prefill_tokens == "auto" and not shard.on_gpu:
        cost = start_cache.cached_step_cost(
            step_cost_key(cfg, plan, engine.runner, idle),
            lambda: calibrate_step_cost(engine.runner, idle, cfg.model.max_model_len, w.max_num_seqs),
        )
        scheduler.set_prefill_budget(*prefill_budgets(cost, idle), cost)
        log.info(
            "prefill beside decodes: %s; %d tokens a step alone",
            cost.describe(CALIBRATION_ROWS) if cost else f"{scheduler.max_prefill_tokens} tokens a step (not measured)",
            scheduler.idle_prefill_tokens,
        )
    return engine, num_blocks * BLOCK_SIZE


def build_follower(cfg: WorkerSettings, plan: LoadPlan, group) -> ModelRunner:
    """A tensor-parallel rank other than 0: its shard and KV share (:func:`load_shard`), as a runner
    for :func:`worker.tp.follow`. No tokenizer, scheduler or sampler: rank 0 has those."""
    shard = load_shard(cfg, plan, group)
    return ModelRunner(shard.model, shard.cache, shard.device)


class _Scratch:
    """Just enough of a Sequence for the runner: ``computed`` of ``num_tokens`` zeros in blocks
    ``first_block…``. Warm-up and calibration passes write only blocks no request holds yet."""

    def __init__(self, num_tokens: int, computed: int, first_block: int, block_size: int):
        self.table = BlockTable(blocks=list(range(first_block, first_block + -(-num_tokens // block_size))))
        self.num_tokens, self.computed = num_tokens, computed

    def tokens(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


def scratch_cache(model, blocks: int, block_size: int, dtype, devices, world: int = 1) -> KVCache:
    """A KV cache of ``blocks`` blocks for this rank's share of ``model``'s layers on ``devices``, for a
    measuring pass before the real cache is sized (the caller drops it)."""
    layers, kv_heads, head_dim = model_mod.kv_shape(model.config, world)
    return KVCache(layers, blocks, block_size, kv_heads, head_dim, dtype, devices)


def measure_prefill_peak(model, devices, tokens: int, block_size: int, dtype, device, world: int = 1) -> None:
    """One forward pass of ``tokens`` prompt tokens over a scratch cache, so the allocator's peak
    (read by ``worker.gpus.kv_budget_after_warmup``) includes the largest step's activations
    (nano-vllm's ``warmup_model`` before ``allocate_kv_cache``). The scratch cache is freed.
    With ``world`` tensor-parallel ranks every rank runs it at once (its sums are collective)."""
    scratch = scratch_cache(model, -(-tokens // block_size), block_size, dtype, devices, world)
    ModelRunner(model, scratch, device).run(StepPlan(prefill=[(_Scratch(tokens, 0, 0, block_size), 0, tokens)]))
    del scratch
    torch.cuda.empty_cache()


def measure_graph_pool(model, devices, cfg: WorkerSettings, plan: LoadPlan, group=None) -> int:
    """Bytes the CUDA graphs of :func:`worker.step.capture.build` will hold, measured over a
    one-block scratch cache (:func:`worker.step.capture.graph_pool_bytes`; 0 where none is captured).
    Held at once with a prefill's activations, so the KV budget leaves out both."""
    scratch = scratch_cache(model, 1, BLOCK_SIZE, model_mod.DTYPES[plan.dtype], devices, plan.world)
    w = cfg.workers
    need = capture.graph_pool_bytes(model, scratch, w.max_num_seqs, w.enforce_eager, group, cfg.model.max_model_len)
    del scratch
    torch.cuda.empty_cache()
    return need


STEP_RATIO = 3.0  # a step that prefills beside decodes may take this many decode steps of its rows (the stall target)
CALIBRATION_ROWS = 4  # decoding sequences beside the calibration chunks (and the larger decode step timed)
CALIBRATION_CONTEXT = 256  # their context, tokens
CALIBRATION_CHUNKS = (16, 64)  # the chunk sizes timed, tokens
CALIBRATION_FAR = 1024  # the later of the two positions they are timed at (the other: a prompt's start)
CALIBRATION_ROUNDS = 3  # each step timed this many times, the fastest kept (others only add time)
# With nothing decoding, a step prefills this many chunks of what a step beside decodes takes at a
# prompt's start (at least MIN_IDLE_CHUNK tokens each): enough for a burst of short prompts to share
# the weight reads and for a document alone to take few steps, few enough that the first of them do
# not wait for the last.
IDLE_CHUNKS = 4
MIN_IDLE_CHUNK = 16


def calibrate_step_cost(
    runner: ModelRunner, most: int, max_model_len: int, max_num_seqs: int, clock=time.perf_counter
) -> StepCost | None:
    """The CPU's ``max_prefill_tokens: auto``: time decode-only steps of 1 and ``CALIBRATION_ROWS``
    rows, and steps of those rows plus a chunk of each of ``CALIBRATION_CHUNKS`` tokens at a
    prompt's start and at ``CALIBRATION_FAR``, and fit :class:`~worker.step_cost.StepCost` with a
    bound of ``STEP_RATIO`` (fastest of ``CALIBRATION_ROUNDS`` wall-clock passes each, the steps
    taking turns, so a busy moment of the machine does not fall on one kind only). On a CPU a prefill
    is compute-bound and its attention grows with the position, so this depends on the model, its
    dtype, the kernels and the cores: measured, not guessed. Positions stay below
    ``max_model_len`` (the RoPE tables' length); None when the cache or ``max_model_len`` is too small
    for the design (the caller keeps a token budget). ``clock``: seconds (a one-thread CPU clock
    measures on a busy machine what the wall clock cannot)."""
    bs = runner.cache.block_size
    rows = max(1, min(CALIBRATION_ROWS, max_num_seqs))
    context = min(CALIBRATION_CONTEXT, max_model_len // 4)
    small, large = min(CALIBRATION_CHUNKS[0], most), min(CALIBRATION_CHUNKS[1], most)
    far = min(CALIBRATION_FAR, max_model_len - large - 1)
    per_seq = -(-max(context + 1, far + large) // bs)
    if small >= large or far < large or (rows + 1) * per_seq > runner.cache.num_blocks:
        return None
    decode = [_Scratch(context, context - 1, i * per_seq, bs) for i in range(rows)]
    plans = {("decode", 1): StepPlan(decode=decode[:1]), ("decode", rows): StepPlan(decode=decode)}
    for n in (small, large):
        for start in (0, far):
            doc = _Scratch(start + n, start, rows * per_seq, bs)
            plans[(n, start)] = StepPlan(decode=decode, prefill=[(doc, start, start + n)])
    best = dict.fromkeys(plans, float("inf"))
    for _ in range(CALIBRATION_ROUNDS):
        for key, plan in plans.items():
            began = clock()
            runner.run(plan)
            best[key] = min(best[key], clock() - began)
    steps = {r: best[("decode", r)] for r in {1, rows}}
    chunks = {k: t for k, t in best.items() if k[0] != "decode"}
    return StepCost.fit(steps, rows, chunks, STEP_RATIO)


def step_cost_key(cfg: WorkerSettings, plan: LoadPlan, runner: ModelRunner, most: int) -> dict:
    """What :func:`calibrate_step_cost` measures depends on, as JSON (the key it is kept under across
    starts, :func:`worker.start_cache.cached_step_cost`): the machine and the threads it runs on, the
    model and its load plan, the kernel each weight runs, the fused step's build, the settings and
    bounds the calibration's design reads, and that design."""
    from worker.quant.autotune import machine_digest
    from worker.step.fused import build_key

    linears = getattr(runner.model, "linears", None)  # None: transformers' forward (no table)
    kernels = (
        [[c.n, c.k, c.weight, [[p.rows, p.kernel] for p in c.picks]] for c, _ in linears.table()] if linears else []
    )
    w = cfg.workers
    return {
        "machine": machine_digest(),
        "threads": torch.get_num_threads(),
        "model": plan.model_path,
        "plan": plan.describe(),
        "kernels": kernels,
        "step": build_key(),
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],  # this calibration's code
        "settings": [w.max_num_seqs, w.enforce_eager, cfg.model.max_model_len, most, runner.cache.num_blocks],
        "design": [STEP_RATIO, CALIBRATION_ROWS, CALIBRATION_CONTEXT, CALIBRATION_CHUNKS, CALIBRATION_FAR],
    }


def prefill_budgets(cost: StepCost | None, most: int) -> tuple[int, int]:
    """Tokens per step beside ``CALIBRATION_ROWS`` decodes at a prompt's start, and with nothing
    decoding (``IDLE_CHUNKS`` such chunks, at most ``most``), from the measured ``cost``; without
    one (a cache too small to calibrate) ``MIN_IDLE_CHUNK`` and four times that."""
    chunk = cost.tokens_within(0, cost.budget(CALIBRATION_ROWS)) if cost is not None else MIN_IDLE_CHUNK
    return max(1, chunk), min(most, IDLE_CHUNKS * max(MIN_IDLE_CHUNK, chunk))


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
