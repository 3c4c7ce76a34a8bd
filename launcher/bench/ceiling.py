"""The in-process ceiling: one static left-padded batch through ``model.generate`` on the same
model and prompts, no server (float32, greedy, exactly the output length with ``ignore_eos``)."""

from __future__ import annotations

import time
from functools import lru_cache

from launcher.bench.prompts import prompt_ids


@lru_cache(maxsize=1)
def load_model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def static_ceiling(model_path: str, tokenizer, prompts: list[list[dict]], output_tokens: int, ignore_eos: bool) -> dict:
    """Output tokens/s of one batch of all ``prompts`` (after a 4-token warm-up of one prompt).

    Returns ``{"batch", "output_tokens", "seconds", "output_tokens_per_s"}``.
    """
    import torch

    model = load_model(model_path)
    ids = [prompt_ids(tokenizer, m) for m in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding_side="left")
    kw = {"max_new_tokens": output_tokens, "do_sample": False, "pad_token_id": pad}
    if ignore_eos:
        kw["min_new_tokens"] = output_tokens
    with torch.inference_mode():
        model.generate(
            **tokenizer.pad({"input_ids": ids[:1]}, return_tensors="pt"),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        t = time.perf_counter()
        out = model.generate(**batch, **kw)
        elapsed = time.perf_counter() - t
    new = out[:, batch["input_ids"].shape[1] :]
    produced = int(sum(min(len(row), output_tokens) for row in new))
    return {
        "batch": len(ids),
        "output_tokens": produced,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": produced / elapsed,
    }
