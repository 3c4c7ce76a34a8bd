"""How often bfloat16 greedy output matches float32's on the same prompts, token for token.

``python -m launcher.bench.dtype_match [--model M] [--tokens N]`` runs each prompt alone through
the real engine in process (CPU), once per dtype, and prints per prompt the tokens both produced
before they first differ, then two rates: the share of prompts whose whole output is identical and
the share of tokens generated before the first divergence (the "token-match rate" in docs/benchmarks/results.md).
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three colors.",
    "Who wrote Hamlet?",
    "Translate 'good morning' to Spanish.",
    "What is 12 times 12?",
    "Tell me a joke about cats.",
    "Write two sentences about the sea.",
    "Describe a good breakfast.",
    "Why is the sky blue?",
    "How do bees make honey?",
    "Give me ideas for a rainy weekend.",
    "What makes a good story?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Name three planets of the solar system.",
]


def greedy_outputs(model_path: str, dtype, prompts: list[str], tokens: int) -> list[list[int]]:
    """Each prompt alone, greedy, exactly ``tokens`` new tokens, through the engine on CPU."""
    import torch

    from worker import model as model_mod
    from worker.attention import KVCache
    from worker.blocks import BlockManager
    from worker.contract.protocol import Generate, SamplingParams, Tokens
    from worker.engine import Engine
    from worker.runner import ModelRunner
    from worker.scheduler import Scheduler

    cpu = torch.device("cpu")
    config = model_mod.load_config(model_path)
    tok = model_mod.load_tokenizer(model_path)
    model = model_mod.load_model(model_mod.plan_in_process(model_path, dtype, 2048))
    layers, kv_heads, head_dim = model_mod.kv_shape(config)
    outs = []
    for text in prompts:
        events: list = []
        cache = KVCache(layers, 64, 16, kv_heads, head_dim, dtype, cpu)
        engine = Engine(
            ModelRunner(model, cache, cpu),
            tok,
            Scheduler(BlockManager(64, 16), 1, 1, 512),
            2048,
            cpu,
            config.vocab_size,
            model_mod.eos_ids(model_path, config, tok),
        )
        ids = tok(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        events += engine.submit(
            Generate(
                request_id="p",
                prompt_token_ids=ids,
                params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
            )
        )
        while engine.has_work:
            events += engine.step()
        outs.append([t for e in events if isinstance(e, Tokens) for t in e.token_ids])
    return outs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    import torch

    from launcher.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    path = str(resolve_model(args.model, progress=False))
    f32 = greedy_outputs(path, torch.float32, PROMPTS, args.tokens)
    bf16 = greedy_outputs(path, torch.bfloat16, PROMPTS, args.tokens)
    same = [common_prefix(a, b) for a, b in zip(f32, bf16, strict=True)]
    for text, n in zip(PROMPTS, same, strict=True):
        print(f"{n:3d}/{args.tokens}  {text}")
    whole = sum(n == args.tokens for n in same)
    print(
        f"identical outputs: {whole}/{len(PROMPTS)} ({whole / len(PROMPTS):.0%}); tokens before the first "
        f"divergence: {sum(same)}/{args.tokens * len(PROMPTS)} ({sum(same) / (args.tokens * len(PROMPTS)):.0%})"
    )


if __name__ == "__main__":
    main()
