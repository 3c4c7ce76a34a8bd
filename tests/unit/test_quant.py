"""Weight-only quantization and the kernels chosen by measurement, on random tensors in process.

The round trip of each format is bounded per group; every kernel candidate this torch build and
CPU can run matches ``F.linear`` on the dequantized weight within its stated tolerance; the choice
table picks by measured time under a fake clock, and a candidate that raises or computes something
else is never picked however fast it is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from worker.attention import KVCache, build_batch
from worker.contract import quant_rules as rules
from worker.contract.protocol import KernelChoice, KernelPick, Ready, decode_for_router, encode
from worker.contract.tp_rules import tp_problems
from worker.llama import LlamaModel, random_weights
from worker.quant import ggml_kernel
from worker.quant.autotune import Pick, buckets, choose, tune
from worker.quant.format import QuantizedWeight, quantize_int4, quantize_int8
from worker.quant.kernels import Candidate, Kernel, candidates, check
from worker.quant.linear import Linears, gather_rows

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on one thread: on a loaded machine a thread pool's barriers cost more than the math."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def symmetric_int4(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Q4_0's rule: ``scale = max|w| / 8`` per group, ``offset = -8 * scale``."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = g.abs().amax(-1) / 8
    q = torch.round(g / scale.unsqueeze(-1) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight(4, q, scale, -8 * scale, group, "Q4_0")


@pytest.mark.parametrize(
    "quantize", [lambda w: quantize_int8(w, 32), lambda w: quantize_int8(w, w.shape[1]), quantize_int4]
)
def test_round_trip_error_is_at_most_half_a_step_per_group(quantize):
    w = weight()
    qw = quantize(w)
    err = (qw.dequantize() - w).abs().view(w.shape[0], -1, qw.group_size)
    assert (err <= qw.scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert qw.nbytes() < w.numel() * 4 * (qw.bits / 32 + 0.2)


def formats() -> dict[str, object]:
    w = weight()
    return {
        "float": w,
        "int8/channel": quantize_int8(w, w.shape[1]),
        "int8/g32": quantize_int8(w, 32),
        "int4/g32": quantize_int4(w, 32),
        "Q4_0/g32": symmetric_int4(w),
    }


# What must be eligible on any CPU this torch build runs on (oneDNN's bfloat16 prepack needs
# avx512bw or avx_ne_convert, so it is left to the check); each name is skipped where the op is absent.
EXPECTED = {
    "float": ["plain-f32", "onednn-f32"],
    "int8/channel": ["dequant-f32", "int8pack-bf16", "int8pack-f32", "int8split-bf16"],
    "int8/g32": ["dequant-f32", "int8group-bf16", "int8group-f32"],
    "int4/g32": ["dequant-f32", "int4pack-bf16", "int4pack-f32", "int4split-bf16"],
    "Q4_0/g32": ["dequant-f32", "int4pack-bf16", "int4pack-f32", "int4split-bf16", "dynquant4"],
}
OPS = {
    "int8pack": "_weight_int8pack_mm",
    "int8group": "_weight_int8pack_mm",
    "int8split": "_weight_int8pack_mm",
    "int4pack": "_weight_int4pack_mm_for_cpu",
    "int4split": "_weight_int4pack_mm_for_cpu",
    "dynquant4": "_dyn_quant_matmul_4bit",
}


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_each_candidate_matches_f_linear_on_the_dequantized_weight(fmt):
    w = formats()[fmt]
    ref = w if isinstance(w, torch.Tensor) else w.dequantize()
    x = torch.randn(5, ref.shape[1], generator=torch.Generator().manual_seed(1))
    eligible = set()
    for cand in candidates(torch.float32, CPU):
        kernel = check(cand, w, torch.float32, CPU)
        if kernel is None:
            continue
        eligible.add(cand.name)
        got = kernel.fn(x)
        assert got.dtype == torch.float32 and got.shape == (5, ref.shape[0])
        bound = F.linear(x.abs(), ref.abs()).amax()
        assert (got - F.linear(x, ref)).abs().amax() <= cand.tolerance * bound, cand.name
    for name in EXPECTED[fmt]:
        op = next((o for prefix, o in OPS.items() if name.startswith(prefix)), None)
        if op is None or hasattr(torch.ops.aten, op):
            assert name in eligible, f"{name} should run on {fmt} here"
    assert not any(name.startswith("float-copy") for name in eligible) or fmt != "float"


def test_bfloat16_compute_always_has_an_eligible_kernel_and_returns_bfloat16():
    """On a CPU without native bfloat16 (AVX2), oneDNN's bf16 prepack raises: it is left out, and
    the layer still runs (plain F.linear), in bfloat16."""
    w = weight()
    choice, built = tune(w, torch.bfloat16, CPU, [1, 2], timer=FakeClock().time)
    assert "plain-bf16" in built
    out = built[choice.picks[0].kernel].fn(torch.randn(2, w.shape[1]).bfloat16())
    assert out.dtype == torch.bfloat16


class FakeClock:
    """A clock that moves only when a fake kernel 'runs' (``cost(rows)`` seconds per call)."""

    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def kernel(self, name: str, cost, wrong: bool = False, held=None):
        w = torch.ones(4, 8)
        storage = held if held is not None else torch.zeros(1)

        def fn(x):
            self.now += cost(x.shape[0])
            return F.linear(x, w) + (1.0 if wrong else 0.0)

        return Candidate(name, 1e-4, lambda *_: True, lambda *_: Kernel(name, fn, (storage,)))


def test_the_table_picks_the_fastest_per_bucket_by_measured_time():
    clock = FakeClock()
    shared = torch.zeros(3)
    pool = [
        clock.kernel("steady", lambda r: 1.0 + 0.1 * r, held=shared),
        clock.kernel("small-rows", lambda r: 0.2 * r, held=shared),  # same storage: no extra memory
        clock.kernel("slow", lambda r: 50.0),
    ]
    choice, _ = tune(torch.ones(4, 8), torch.float32, CPU, [1, 2, 4, 8, 16], timer=clock.time, pool=pool)
    # steady: 1.1, 1.2, 1.4, 1.8, 2.6 s; small-rows: 0.2, 0.4, 0.8, 1.6, 3.2 s
    assert [p.kernel for p in choice.picks] == ["small-rows"] * 4 + ["steady"]
    assert choice.picks[0].seconds == pytest.approx(0.2)
    assert list(choice.times["slow"]) == [1]  # 250x the best at one row: not timed again


def test_a_second_form_is_kept_only_where_it_is_ten_percent_faster():
    times = {"packed": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, "plain": {1: 0.95, 2: 0.5, 4: 1.2, 8: 2.0}}
    kernels = [Kernel("packed", None, (torch.zeros(1),)), Kernel("plain", None, (torch.zeros(1),))]
    picks = choose(kernels, times, [1, 2, 4, 8])
    assert picks == [Pick(1, "packed", 1.0), Pick(2, "plain", 0.5), Pick(4, "packed", 1.0), Pick(8, "packed", 1.0)]


def test_raising_or_mismatching_candidates_are_never_picked_however_fast():
    clock = FakeClock()

    def raising(*_):
        raise RuntimeError("needs the cpu support avx_ne_convert or avx512bw")

    pool = [
        clock.kernel("honest", lambda r: 1.0),
        clock.kernel("wrong", lambda r: 0.001, wrong=True),
        Candidate("raises", 1e-4, lambda *_: True, raising),
    ]
    choice, built = tune(torch.ones(4, 8), torch.float32, CPU, [1, 2, 4], timer=clock.time, pool=pool)
    assert list(built) == ["honest"] and choice.eligible == ["honest"]
    assert {p.kernel for p in choice.picks} == {"honest"}
    with pytest.raises(RuntimeError, match="no kernel"):
        tune(torch.ones(4, 8), torch.float32, CPU, [1], timer=clock.time, pool=pool[1:])


def test_float_copies_of_a_quantized_weight_only_when_allowed():
    qw = quantize_int8(weight(), 128)
    _, plain = tune(qw, torch.float32, CPU, [1], timer=FakeClock().time)
    _, copies = tune(qw, torch.float32, CPU, [1], allow_copies=True, timer=FakeClock().time)
    assert not any(n.startswith("float-copy") for n in plain)
    assert "float-copy-f32" in copies


def test_buckets_cover_the_largest_step_up_to_the_cap():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(100_000)[-1] == 128


def tiny_config(tied: bool = True) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def model_with(quantization: str, dtype=torch.float32, config=None, max_rows: int = 4) -> LlamaModel:
    config = config or tiny_config()
    linears = Linears(CPU, dtype, quantization, max_rows=max_rows, max_logit_rows=1, timer=FakeClock().time)
    weights = random_weights(config, CPU, dtype)
    model = LlamaModel(
        config, weights, CPU, dtype, 64, linear=linears, head_linear=linears.head, embedding=linears.embedding
    )
    linears.count(model.norm)
    for layer in model.layers:
        linears.count(layer.attn_norm)
        linears.count(layer.mlp_norm)
    model.linears = linears
    return model


def logits(model: LlamaModel, n: int) -> torch.Tensor:
    layers, kvh, d = 2, 2, 16
    cache = KVCache(layers, 4, 16, kvh, d, model.dtype, CPU)
    batch = build_batch(16, CPU, [], [([0, 1], 0, n)])
    return model.forward(torch.arange(3, 3 + n), torch.arange(n), batch, cache, torch.tensor([n - 1]))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_model_is_close_to_the_float_one_and_holds_far_fewer_bytes(quantization):
    ref = model_with("none")
    q = model_with(quantization)
    for n in (1, 3, 20):  # three buckets (20: beyond the last): each may run its own kernel
        a, b = logits(ref, n), logits(q, n)
        assert torch.nn.functional.cosine_similarity(a, b).item() > 0.99
    kinds = {c.weight for c, _ in q.linears.table()}
    if ggml_kernel.load():  # ggml_quantize_chunk's Q8_0 / Q4_1 blocks (the embedding and LM head: Q8_0)
        assert kinds == ({"Q8_0/g32"} if quantization == "int8" else {"Q4_1/g32", "Q8_0/g32"})
    else:
        assert kinds == ({"int8/channel"} if quantization == "int8" else {"int4/g32", "int8/channel"})
    # against the float32 weights held once (the float model's own count depends on its kernels: a
    # prepacked oneDNN copy of the tied LM head counts twice); on this tiny model the Q8_0 embedding and
    # LM head and the float norms are a larger share than on a real one
    float_bytes = 4 * sum(t.numel() for t in random_weights(tiny_config(), CPU, torch.float32).values())
    assert q.linears.weight_bytes < (0.3 if quantization == "int8" else 0.35) * float_bytes


def test_int8_weight_memory_meets_the_targets_against_bfloat16_and_float32(monkeypatch):
    """int8 ≤ 0.55x bfloat16's and ≤ 0.3x float32's weight memory, tied embeddings included, the float
    models running torch's kernels (the fake clock picks by name: ggml's float kernels, holding one
    copy of a tied table where oneDNN's prepacked head holds a second, would pick themselves here)."""
    monkeypatch.setattr(ggml_kernel, "accepts_float", lambda *_: False)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=2048,
        tie_word_embeddings=True,
    )
    f32 = model_with("none", config=config, max_rows=1).linears.weight_bytes
    bf16 = model_with("none", torch.bfloat16, config=config, max_rows=1).linears.weight_bytes
    int8 = model_with("int8", config=config, max_rows=1).linears.weight_bytes
    assert int8 <= 0.55 * bf16 and int8 <= 0.3 * f32


def test_quantized_embedding_rows_are_the_dequantized_rows():
    table = weight(50, 64)
    for qw in (quantize_int8(table, 64), quantize_int4(table, 32)):
        ids = torch.tensor([0, 7, 7, 49])
        assert torch.allclose(gather_rows(qw, ids), qw.dequantize()[ids])


def test_dispatch_runs_the_pick_of_the_smallest_bucket_that_holds_the_rows():
    linears = Linears(CPU, torch.float32, "none", max_rows=8, timer=FakeClock().time)
    seen = []
    kernels = {
        "a": Kernel("a", lambda x: seen.append("a"), ()),
        "b": Kernel("b", lambda x: seen.append("b"), ()),
    }
    picks = [Pick(1, "a", 1), Pick(2, "a", 1), Pick(4, "b", 1), Pick(8, "a", 1)]
    run = linears.dispatch(picks, kernels)
    for t in (1, 2, 3, 4, 5, 8, 600):
        run(torch.zeros(t, 1))
    assert seen == ["a", "a", "b", "b", "a", "a", "a"]


def test_int4_groups_must_not_straddle_a_tensor_parallel_split():
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
    }
    assert tp_problems(config, 3, "int4") == []  # 576 / 3 = 192 and 1536 / 3 = 512: whole groups
    assert tp_problems(config, 3, "int8") == []
    bad = dict(config, intermediate_size=1548, num_attention_heads=12, num_key_value_heads=6, hidden_size=768)
    (line,) = tp_problems(bad, 3, "int4")
    assert line.startswith("model.quantization: int4 needs") and "MLP width 1548 / 3 ranks" in line
    assert "use int8 or another workers.tensor_parallel_size" in line
    assert tp_problems(bad, 3, "int8") == []
    assert rules.group_size(8, 576) == 576 and rules.group_size(4, 576) == 32


def test_the_kernel_table_travels_in_ready():
    table = [KernelChoice(n=3072, k=576, weight="int8/channel", count=30, picks=[KernelPick(1, "int8pack-bf16", 0.08)])]
    msg = decode_for_router(
        encode(Ready(worker_id=0, load_seconds=1.0, kv_budget_tokens=16, weight_bytes=5, kernels=table))
    )
    assert msg.kernels == table and msg.weight_bytes == 5


def test_doctor_measures_the_model_shapes_here_and_skips_models_too_large_to_measure():
    from launcher.config import DeployConfig
    from launcher.plan.doctor_kernels import kernel_check
    from worker.contract.shapes import ModelShape

    cfg = DeployConfig.model_validate({"model": {"quantization": "int4"}, "workers": {"max_num_seqs": 2}})
    tiny = ModelShape("tiny", 64, 2, 4, 2, 16, 128, 96, tie_word_embeddings=True)
    status, detail, _ = kernel_check(cfg, tiny, "cpu", "float32")
    assert status == "ok", detail
    lines = detail.splitlines()
    assert lines[0] == "cpu, float32, model.quantization int4, rows 1-2:"
    int4, rows8 = ("Q4_1/g32", "Q8_0/g32") if ggml_kernel.load() else ("int4/g32", "int8/channel")
    assert [line.split(":")[0] for line in lines[1:]] == [
        f"128x64 {int4}",
        f"64x64 {int4}",
        f"256x64 {int4}",
        f"64x128 {int4}",
        f"96x64 {rows8}",
    ]
    big = ModelShape("70b", 8192, 80, 64, 8, 128, 28672, 32000)
    assert kernel_check(cfg, big, "cpu", "float32")[0] == "skip"
