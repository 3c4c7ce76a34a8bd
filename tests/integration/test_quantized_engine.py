"""The engine in process on the embedded SmolLM2-135M quantized at load (``model.quantization: int8``
and ``int4``), and in bfloat16 on whatever CPU runs the tests (oneDNN's bfloat16 prepack raises on
CPUs without avx512bw/avx_ne_convert; the kernel table must leave it out, never crash).

Greedy int8 output is compared with float32's over 16 prompts and the count of identical answers
printed, not asserted: int8 weights move the logits a little, and a near-tie can go the other way.
"""

from __future__ import annotations

import pytest
import torch

from launcher.models import resolve_model
from tests.helpers.engine_run import QUESTIONS, Run, chat_ids
from worker import model as model_mod
from worker.contract.protocol import Tokens
from worker.quant import ggml_kernel

CPU = torch.device("cpu")
MORE = [
    "Name a planet in our solar system.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "What is the largest ocean?",
    "Suggest a name for a dog.",
    "What does a thermometer measure?",
]
PROMPTS = QUESTIONS + MORE  # 16


@pytest.fixture(scope="module")
def base():
    torch.set_num_threads(1)  # one core: the suite shares the machine
    path = str(resolve_model("smollm2-135m-instruct", progress=False))
    config = model_mod.load_config(path)
    tok = model_mod.load_tokenizer(path)
    return path, config, tok, model_mod.eos_ids(path, config, tok)


def load(base, quantization: str, dtype=torch.float32):
    path, config, tok, eos = base
    model = model_mod.load_model(model_mod.plan_in_process(path, dtype, 2048, quantization, rows=(16, 16)))
    return model, tok, config, eos


@pytest.fixture(scope="module")
def float32(base):
    return load(base, "none")


@pytest.fixture(scope="module")
def int8(base):
    # bfloat16 compute where the ggml kernels run: in float32 their 8-bit activations take the README
    # question's first-token near-tie ("The" 25.33, "L" 25.24) the other way
    return load(base, "int8", torch.bfloat16 if ggml_kernel.load() else torch.float32)


def answers(loaded, prompts: list[str], max_tokens: int = 24) -> list[str]:
    run = Run(loaded, max_num_seqs=16)
    for i, p in enumerate(prompts):
        run.submit(f"r{i}", chat_ids(loaded[1], p), max_tokens=max_tokens)
    run.drain()
    assert not run.failed()
    return [run.text(f"r{i}") for i in range(len(prompts))]


def test_int8_answers_paris_and_holds_a_fraction_of_the_float_weights(int8, float32):
    run = Run(int8, max_num_seqs=16)
    run.submit("q", chat_ids(int8[1], "What is the capital of France?"), max_tokens=8, logprobs=2)
    run.drain()
    first = next(e.logprobs[0] for e in run.events if isinstance(e, Tokens) and e.logprobs)
    # Q8_0 with ggml's 8-bit activations (llama.cpp's arithmetic) sits on the question's first-token near-tie
    # ("The" 25.33 against "L" 25.24 in float32): the kernels the table picks by timing decide the side, so
    # the answer's path ("The capital of France is Paris.") must be one of the two most likely first tokens
    the = int8[1].encode("The", add_special_tokens=False)
    assert len(the) == 1 and the[0] in [first.token_id] + [t for t, _ in first.top], (run.text("q"), first)
    linears = int8[0].linears
    # every linear, the LM head too: Q8_0 blocks by ggml_quantize_chunk where the ggml kernels are built
    assert {c.weight for c, _ in linears.table()} == {"Q8_0/g32" if ggml_kernel.load() else "int8/channel"}
    assert linears.weight_bytes <= 0.3 * float32[0].linears.weight_bytes
    assert all(p.kernel for c in linears.report() for p in c.picks)


def test_int4_answers_paris(base):
    model = load(base, "int4")
    (text,) = answers(model, ["What is the capital of France?"])
    assert "Paris" in text, text
    want = {"Q4_1/g32", "Q8_0/g32"} if ggml_kernel.load() else {"int4/g32", "int8/channel"}
    assert {c.weight for c, _ in model[0].linears.table()} == want


def test_bfloat16_starts_on_this_cpu_and_answers(base):
    """oneDNN's bfloat16 prepack is a candidate like any other: on a CPU that cannot run it, it is
    ineligible and the layers run another kernel instead of the worker failing at start."""
    model = load(base, "none", torch.bfloat16)
    kernels = {p.kernel for c in model[0].linears.report() for p in c.picks}
    assert kernels and all(k.endswith("-bf16") for k in kernels), kernels
    (text,) = answers(model, ["What is the capital of France?"])
    assert "Paris" in text, text


def test_greedy_int8_against_float32_over_16_prompts(int8, float32):
    quantized, reference = answers(int8, PROMPTS), answers(float32, PROMPTS)
    same = sum(a == b for a, b in zip(quantized, reference, strict=True))
    print(f"\ngreedy int8 vs float32, 24 tokens each: {same} of {len(PROMPTS)} answers identical")
    for p, a, b in zip(PROMPTS, quantized, reference, strict=True):
        if a != b:
            print(f"  {p!r}\n    int8:    {a!r}\n    float32: {b!r}")
    assert all(quantized)
