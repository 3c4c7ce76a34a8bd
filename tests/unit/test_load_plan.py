"""The load plan as pure logic (:mod:`worker.contract.load_plan`): settings, injected machine facts and
model facts in, one :class:`LoadPlan` out, with the problems the worker refuses to load."""

from __future__ import annotations

import pytest

from worker.contract.load_plan import LoadPlan, Machine, ModelFacts, resolve_load_plan
from worker.contract.settings import WorkerSettings
from worker.contract.shapes import GgufTypes

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
}
QWEN = {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}
ZEN3 = frozenset({"avx2", "fma", "avx512f"})  # no bf16 arithmetic
ZEN4 = ZEN3 | {"avx512_bf16"}
GiB = 2**30
OLD_CPU = Machine("cpu", cpu_flags=ZEN3)


def plan(model=None, workers=None, machine=OLD_CPU, facts=None, **kw) -> LoadPlan:
    cfg = WorkerSettings.model_validate({"model": model or {}, "workers": workers or {}})
    return resolve_load_plan(cfg.model, cfg.workers, machine, facts or ModelFacts("/m", "generate", LLAMA), **kw)


def test_a_cpu_without_bf16_computes_in_float32_and_warns_against_an_explicit_bfloat16():
    auto = plan()
    assert (auto.dtype, auto.device, auto.forward, auto.source) == ("float32", "cpu", "llama", "safetensors")
    assert "neither avx512_bf16 nor amx_bf16" in auto.dtype_note and auto.dtype_warning == ""
    assert (auto.memory_fraction, auto.max_memory, auto.problem) == (None, None, "")
    assert plan(machine=Machine("cpu", cpu_flags=ZEN4)).dtype == "bfloat16"
    forced = plan({"dtype": "bfloat16"})
    assert forced.dtype == "bfloat16" and "emulated" in forced.dtype_warning


def test_the_kernels_rows_follow_the_cpu_prefill_budget_and_the_batch():
    p = plan(workers={"max_num_seqs": 4, "deterministic": True})
    assert p.prefill_budgets == (32, 512) and p.rows == (4 + 512, 4) and p.deterministic
    assert "up to 516 rows (LM head 4), batch-invariant" in p.describe()


def test_a_gpu_inventory_takes_its_weakest_gpu_and_splits_layers_over_several():
    one = plan(
        workers={"gpu_memory_utilization": 0.8},
        machine=Machine("cuda", ((9, 0),), (80 * GiB,), ZEN3, share=0.5),
    )
    assert (one.dtype, one.forward, one.max_memory) == ("bfloat16", "llama", None)
    assert one.memory_fraction == pytest.approx(0.4) and one.prefill_budgets == (2048, 8192)
    two = plan(
        workers={"gpu_memory_utilization": 0.8},
        machine=Machine("cuda", ((8, 0), (7, 5)), (16 * GiB, 24 * GiB), ZEN3, share=0.5),
    )
    assert two.dtype == "float16"  # a T4 (7.5) beside an A100 has no bf16 tensor cores
    assert (two.forward, two.forward_note) == ("transformers", "layer split over several GPUs")
    assert two.gpu_max_memory == {0: int(16 * GiB * 0.4), 1: int(24 * GiB * 0.4)}
    assert two.problem == ""
    assert "layers split over 2 GPUs" in two.describe()


def test_a_gguf_file_under_quantization_auto_is_served_as_stored():
    stored = GgufTypes("Q4_1", "Q4_1", "Q6_K")
    p = plan(facts=ModelFacts("/m", "generate", LLAMA, "/m/model.gguf", stored))
    assert (p.source, p.gguf_file, p.quantization) == ("gguf", "/m/model.gguf", "none")
    assert p.weight_format.quantized and p.weight_format.name == "Q4_1"
    assert p.weight_format.problem  # Q6_K is not served as stored: said, counted dequantized
    assert "weights from /m/model.gguf, Q4_1 as stored" in p.describe()
    q8 = plan(facts=ModelFacts("/m", "generate", LLAMA, "/m/model.gguf", GgufTypes("Q8_0", "Q8_0")))
    assert q8.weight_format.linear.bits == 8 and not q8.weight_format.problem


def test_int8_at_load_is_planned_for_the_linears_only_on_the_compact_forward():
    p = plan({"quantization": "int8"})
    assert (p.quantization, p.weight_format.name) == ("int8", "int8")
    assert "int8 at load" in p.describe()
    refused = plan({"quantization": "int8"}, facts=ModelFacts("/m", "generate", QWEN))
    assert refused.forward == "transformers" and refused.forward_note.startswith("architecture")
    with pytest.raises(ValueError, match=r"model.quantization: int8 needs a Llama-family model on one device"):
        refused.check()


def test_tensor_parallel_2_shards_a_model_that_divides_and_refuses_one_that_does_not():
    p = plan(rank=1, world=2)
    assert (p.rank, p.world, p.problem) == (1, 2, "")
    assert p.describe().startswith("generate on cpu rank 1 of 2;")
    odd = plan(
        facts=ModelFacts("/m", "generate", {**LLAMA, "num_attention_heads": 9, "num_key_value_heads": 3}), world=2
    )
    assert odd.problem.startswith("workers.tensor_parallel_size: 2 does not divide the model's 9 attention heads")
    other = plan(facts=ModelFacts("/m", "generate", QWEN), world=2)
    assert "needs a Llama-family model on one GPU per rank" in other.problem
    int4 = plan(
        {"quantization": "int4"}, facts=ModelFacts("/m", "generate", {**LLAMA, "intermediate_size": 1056}), world=2
    )
    assert "int4 needs input widths in whole 32-value groups" in int4.problem


def test_what_only_the_compact_forward_runs_is_refused_elsewhere():
    split = Machine("cuda", ((9, 0), (9, 0)), (GiB, GiB))
    gguf = plan(facts=ModelFacts("/m", "generate", LLAMA, "/m/model.gguf"), machine=split)
    assert gguf.problem.startswith("a GGUF file is served as stored on the engine's Llama-family forward")
    assert "not with workers.gpus_per_replica > 1" in gguf.problem
    noise = plan({"random_init": True}, facts=ModelFacts("/m", "generate", QWEN))
    assert noise.source == "random"
    assert noise.problem.startswith("model.random_init needs a Llama-family model on one device (architecture")


def test_an_embedding_model_is_planned_on_one_device_in_the_float_dtype():
    p = plan(machine=Machine("cpu", cpu_flags=ZEN4), facts=ModelFacts("/e", "embed"))
    assert (p.task, p.forward, p.dtype, p.problem) == ("embed", "embed", "bfloat16", "")
    assert p.describe() == "embed on cpu; dtype auto → bfloat16 (CPU has avx512_bf16)"
    assert "runs on one device" in plan(facts=ModelFacts("/e", "embed"), world=2).problem


def test_the_plan_is_frozen_and_one_line():
    p = plan()
    with pytest.raises(AttributeError):
        p.dtype = "float16"
    assert "\n" not in p.describe()
