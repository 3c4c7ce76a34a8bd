"""The captured decode step (worker/step) against the eager forward pass, in process on the embedded
model in float32: its fused operators against torch's operations, the same greedy tokens over 16
prompts, and the steps it cannot serve (more rows than its buckets, prompt logprobs) run eagerly,
counted, with the same answers."""

import pytest
import torch
import torch.nn.functional as F

from launcher.bench.dtype_match import PROMPTS
from tests.helpers.engine_run import Run, chat_ids
from worker.contract.protocol import Tokens
from worker.cpu_share import WINDOW_S, Readings, ThreadGovernor
from worker.llama import rms_norm_cpu
from worker.step import capture, fused


@pytest.fixture(scope="module")
def ops():
    module = fused.load()
    assert module is not None, "the fused operators did not build (see the log)"
    return module


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return [chat_ids(loaded[1], q) for q in PROMPTS]


def captured(loaded, max_num_seqs: int = 8, capture_seqs: int | None = None, **kw) -> Run:
    run = Run(loaded, max_num_seqs=max_num_seqs, **kw)
    run.engine.runner.capture = capture.build(run.engine.runner.model, run.cache, capture_seqs or max_num_seqs, False)
    return run


def answers(run: Run, prompts: list[list[int]], lengths: list[int] | None = None, **params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        run.submit(f"r{i}", p, **params, **({"max_tokens": lengths[i]} if lengths else {}))
    run.drain()
    return [run.tokens(f"r{i}") for i in range(len(prompts))]


def scored(run: Run, n: int) -> list:
    """Each request's prompt logprobs (token ids and their top ids), as its first message carried them."""
    firsts = [next(e for e in run.events if isinstance(e, Tokens) and e.request_id == f"r{i}") for i in range(n)]
    return [[(lp.token_id, [t for t, _ in lp.top]) for lp in e.prompt_logprobs] for e in firsts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_operators_match_torch(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, dtype), rms_norm_cpu(x, w, 1e-5).to(dtype), **tol)
    residual, delta = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g).to(dtype)
    added = residual + delta
    normed = ops.add_rms_norm(residual, delta, w, 1e-5, dtype)  # in place, then the norm: the same bits
    assert torch.equal(residual, added) and torch.equal(normed, ops.rms_norm(added, w, 1e-5, dtype))
    # SiLU·up calls the exp torch's own SiLU kernel calls (SLEEF's, by vectors, the tail by std::exp):
    # 40 values a row, so one full vector of 16 or 8 and a tail
    gu = (4 * torch.randn(3, 2 * 40, generator=g)).to(dtype)
    gate, up = gu.chunk(2, -1)
    assert torch.equal(ops.silu_mul(gu, dtype, dtype), F.silu(gate) * up)
    # RoPE + cache write, then attention over block tables, against SDPA over the same keys
    H, KVH, D, block = 4, 2, 8, 4
    cos, sin = torch.randn(32, D, generator=g), torch.randn(32, D, generator=g)
    kv = torch.randn(64, 2, KVH, D, generator=g).to(dtype)
    qkv = torch.randn(2, (H + 2 * KVH) * D, generator=g).to(dtype)
    pos, tables, lens = torch.tensor([5, 9]), torch.tensor([[3, 1, 0], [7, 2, 5]]), torch.tensor([6, 10])
    slots = torch.tensor([1 * block + 1, 5 * block + 1])
    q = ops.rope_cache(qkv, cos, sin, pos, kv, slots, H, KVH, dtype)
    qk = qkv[:, : (H + KVH) * D].view(2, H + KVH, D)
    c, s = cos[pos].to(dtype)[:, None], sin[pos].to(dtype)[:, None]
    rotated = qk * c + qk.roll(D // 2, -1) * s
    torch.testing.assert_close(q, rotated[:, :H], atol=0, rtol=0)
    torch.testing.assert_close(kv[slots, 0], rotated[:, H:], atol=0, rtol=0)
    torch.testing.assert_close(kv[slots, 1], qkv[:, (H + KVH) * D :].view(2, KVH, D), atol=0, rtol=0)
    out = ops.paged_attention(q, kv, tables, torch.empty(0, dtype=torch.long), lens, block, D**-0.5, dtype)
    for b in range(2):
        ctx = [int(tables[b, j // block]) * block + j % block for j in range(int(lens[b]))]
        k, v = kv[ctx, 0].transpose(0, 1), kv[ctx, 1].transpose(0, 1)  # [KVH, L, D]
        ref = F.scaled_dot_product_attention(q[b].view(KVH, H // KVH, D), k, v, scale=D**-0.5)
        torch.testing.assert_close(out[b], ref.reshape(-1), **tol)


def test_captured_and_eager_steps_give_the_same_greedy_tokens(loaded, prompts, ops):
    eager = answers(Run(loaded), prompts, max_tokens=16)
    run = captured(loaded)
    assert answers(run, prompts, max_tokens=16) == eager
    counts = run.engine.stats()
    assert counts.captured_steps > 0 and counts.eager_decode_steps == 0
    assert run.engine.runner.capture.prefill_steps > 0  # the prompts' chunks went through it too
    alone = captured(loaded)
    assert answers(alone, prompts[:1], max_tokens=16) == eager[:1]  # batch 1: the profiled case


def test_steps_the_capture_cannot_serve_run_eagerly_and_are_counted(loaded, prompts, ops):
    eager_run = Run(loaded)
    lengths = [4, 6, 12, 12]  # 4 rows, then 3, then 2: the last steps fit the buckets
    eager = answers(eager_run, prompts[:4], lengths, prompt_logprobs=2, ignore_eos=True)
    run = captured(loaded, max_num_seqs=4, capture_seqs=2)  # 3 or 4 rows: more than its buckets
    assert answers(run, prompts[:4], lengths, prompt_logprobs=2, ignore_eos=True) == eager
    stats = run.engine.stats()
    assert stats.eager_decode_steps > 0 and stats.captured_steps > 0  # the batch shrinks to 2 rows at the end
    assert run.engine.runner.capture.prefill_steps == 0  # chunks scoring prompt logprobs stay eager
    assert scored(run, 4) == scored(eager_run, 4) and all(scored(run, 4))


def test_enforce_eager_runs_every_step_eagerly(loaded, prompts):
    run = Run(loaded)
    run.engine.runner.capture = capture.build(run.engine.runner.model, run.cache, 8, True)
    assert answers(run, prompts[:2], max_tokens=4) and run.engine.stats().captured_steps == 0
    assert run.engine.stats().eager_decode_steps > 0


def logprobs(run: Run, n: int) -> list:
    """Each request's sampled tokens' logprobs with their top alternatives, in order."""
    return [
        [
            (lp.token_id, lp.logprob, lp.top)
            for e in run.events
            if isinstance(e, Tokens) and e.request_id == f"r{i}"
            for lp in e.logprobs or []
        ]
        for i in range(n)
    ]


def test_a_batch_invariant_model_is_captured_with_the_eager_steps_values(loaded, prompts, ops):
    """``workers.deterministic``: the captured step serves it, and each decode step's logits are bit
    for bit the eager step's (the same RMSNorm and attention operators; RoPE and SiLU·up round as
    the eager operations do), so whether a step was captured changes no logprob."""
    model = loaded[0]
    model.invariant = True
    try:
        eager = Run(loaded)
        want = answers(eager, prompts[:3], max_tokens=8, logprobs=2)
        run = captured(loaded)
        assert answers(run, prompts[:3], max_tokens=8, logprobs=2) == want
        assert run.engine.stats().captured_steps > 0 and run.engine.stats().eager_decode_steps == 0
        assert run.engine.runner.capture.prefill_steps > 0  # prompt chunks served by it: the same bits
        assert logprobs(run, 3) == logprobs(eager, 3) and all(logprobs(run, 3))
    finally:
        model.invariant = False


class Contended:
    """Readings for a thread governor that close a window at every loop turn and say, in turn, that
    the cores are taken and that they are free: the count moves between one and two threads every
    few steps. ``applied`` records each count set."""

    def __init__(self):
        self.now, self.turns, self.applied = 0.0, 0, []
        self.waiting = self.idle = 0.0

    def clock(self) -> float:
        self.now += WINDOW_S
        return self.now

    def read(self) -> Readings:
        self.turns += 1
        if self.turns % 3 == 0:  # a window in which the engine's thread waited to run all the time
            self.waiting += WINDOW_S
        else:  # two idle cores: two such windows give the threads back
            self.idle += 2 * WINDOW_S
        return Readings(threads={1: (0.0, self.waiting)}, idle_s=self.idle)

    def set_threads(self, n: int) -> None:
        self.applied.append(n)
        torch.set_num_threads(n)


def test_a_change_of_compute_threads_mid_stream_changes_no_logprob(loaded, prompts, ops):
    """The thread governor (worker/cpu_share.py) moves a CPU worker's steps between one and two
    threads at any step; with ``workers.deterministic`` every value is computed by one thread in one
    order, so the tokens and logprobs are those of a run on two threads throughout."""
    model = loaded[0]
    model.invariant = True
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = captured(loaded)
        want = answers(fixed, prompts[:3], max_tokens=12, logprobs=2)
        box = Contended()
        governed = captured(loaded, governor=ThreadGovernor(2, box.read, box.set_threads, clock=box.clock))
        assert answers(governed, prompts[:3], max_tokens=12, logprobs=2) == want
        assert logprobs(governed, 3) == logprobs(fixed, 3)
        assert box.applied.count(1) >= 3 and box.applied.count(2) >= 3, box.applied
        assert governed.engine.stats().thread_changes == len(box.applied)
    finally:
        model.invariant = False
        torch.set_num_threads(before)


def two_decode_rows(loaded, prompts) -> tuple[Run, list, torch.Tensor]:
    """Two prompts prefilled into blocks 0-7 and 10-17, then one eager decode step of both:
    ``(run, the rows as the graphs take them, the eager step's logits [2, V])``."""
    run = Run(loaded)
    runner, (a, b) = run.engine.runner, prompts[:2]
    ta, tb = list(range(0, 8)), list(range(10, 18))
    ids, pos = torch.tensor(a + b), torch.tensor([*range(len(a)), *range(len(b))])
    runner.forward(ids, pos, [], [(ta, 0, len(a)), (tb, 0, len(b))], torch.tensor([len(a) - 1]))
    eager = runner.forward(
        torch.tensor([42, 7]), torch.tensor([len(a), len(b)]), [(ta, len(a) + 1), (tb, len(b) + 1)], [], torch.arange(2)
    )
    return run, [(ta, len(a), 42), (tb, len(b), 7)], eager


def test_cuda_graph_forward_matches_the_eager_step_on_cpu(loaded, prompts):
    """The forward the CUDA graphs capture (static shapes: whole-width tables, padded rows), run
    eagerly on CPU: the same logits as the eager step for the real rows."""
    from worker.step import graphs

    run, rows, eager = two_decode_rows(loaded, prompts)
    packed = torch.tensor(graphs.packed_inputs(graphs.pad_rows(rows, 4), 128, run.cache.block_size))
    got = graphs.static_forward(run.engine.runner.model, run.cache, packed, 4)
    torch.testing.assert_close(got[:2], eager, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], got[0])  # a padded row repeats row 0


def test_a_batch_invariant_cuda_graph_forward_gives_the_eager_steps_bits(loaded, prompts, monkeypatch):
    """``workers.deterministic`` where no compiled attention operator runs (a GPU): the eager step
    attends with ``attention.attend_invariant`` and the graphs' forward with the same arithmetic at
    its tables' full width, so a decode row's logits are the same bits captured or not (on an H200
    they differed while the graphs ran SDPA: docs/benchmarks/results.md). Run on CPU with the
    compiled operators switched off, as they are on a GPU; two rows in a bucket of two, over
    tables 128 blocks wide (the eager step's context: 3 blocks), so only the attention's width
    differs (padded rows meet the row-count-invariant kernels of a deterministic table:
    tests/unit/test_batch_invariance.py)."""
    from worker import attention
    from worker.step import graphs

    monkeypatch.setattr(attention, "_OPS", [None])
    model = loaded[0]
    model.invariant = True
    try:
        run, rows, eager = two_decode_rows(loaded, prompts)
        packed = torch.tensor(graphs.packed_inputs(rows, 128, run.cache.block_size))
        got = graphs.static_forward(model, run.cache, packed, 2)
    finally:
        model.invariant = False
    assert torch.equal(got, eager)


def test_the_captured_step_adds_attention_biases_where_the_eager_step_does(ops):
    """A Llama with ``attention_bias`` (q/k/v and o_proj biases, random): under batch invariance the
    captured decode step's logits are bit for bit the eager step's, o_proj's bias added after its
    output into the residual, then the MLP's norm (the fused residual add takes the bias as a
    second add, not the output plus the bias)."""
    from transformers import LlamaConfig

    from worker.attention import KVCache, build_batch
    from worker.llama import LlamaModel, random_weights
    from worker.step.decode import FusedDecode

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
        max_position_embeddings=64,
        attention_bias=True,
    )
    cpu, g = torch.device("cpu"), torch.Generator().manual_seed(1)
    weights = random_weights(config, cpu, torch.float32)
    for i in range(config.num_hidden_layers):
        for name, width in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
            weights[f"model.layers.{i}.self_attn.{name}_proj.bias"] = torch.randn(width, generator=g) * 0.5
    model = LlamaModel(config, weights, cpu, torch.float32, 64)
    assert all(layer.o_bias is not None and layer.qkv_bias is not None for layer in model.layers)
    model.invariant = True
    cache = KVCache(2, 4, 16, 2, 16, torch.float32, cpu)
    prompt, table = list(range(3, 23)), [0, 1]
    model.forward(torch.tensor(prompt), torch.arange(20), build_batch(16, cpu, [], [(table, 0, 20)]), cache, None)
    eager = model.forward(
        torch.tensor([7]), torch.tensor([20]), build_batch(16, cpu, [(table, 21)], []), cache, torch.tensor([0])
    )
    captured = FusedDecode(model, cache, ops).forward_rows([(table, 20, 7)])
    assert torch.equal(captured, eager)
    model.layers[0].o_bias = None  # the bias counts: without it the logits move
    assert not torch.equal(FusedDecode(model, cache, ops).forward_rows([(table, 20, 7)]), eager)
