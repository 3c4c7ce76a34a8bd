"""Prompt logprobs in the engine, in process, on the real embedded model in float32 on CPU.

Every prompt position is scored whatever way the prompt is computed — in one pass, in many small
prefill chunks, after its prefix was cached by an earlier request, after a preemption — and the
values are transformers' own (the reference model run over the whole prompt at once).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from launcher.models import resolve_model
from tests.helpers.engine_run import Run, chat_ids
from worker.contract.protocol import Tokens

TOL = 1e-3


@pytest.fixture(scope="module")
def document(loaded) -> list[int]:
    text = " ".join(
        f"Item {i}: the board approved line {i * 13} after a vote of {i % 5} to {i % 3}." for i in range(10)
    )
    return chat_ids(loaded[1], "Summarise this.\n\n" + text)


@pytest.fixture(scope="module")
def reference(document) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole document, float32: [P, V]."""
    path = str(resolve_model("smollm2-135m-instruct", progress=False))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([document])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def first_event(run: Run, rid: str) -> Tokens:
    return next(e for e in run.events if isinstance(e, Tokens) and e.request_id == rid)


def assert_matches(entries, document: list[int], reference: torch.Tensor, top: int) -> None:
    assert [e.token_id for e in entries] == document[1:]
    want = reference[torch.arange(len(document) - 1), torch.tensor(document[1:])]
    got = torch.tensor([e.logprob for e in entries])
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
    if not top:
        assert all(e.top == [] for e in entries)
        return
    best = reference[:-1].topk(top + 1, dim=-1)
    for e, ids, vals in zip(entries, best.indices.tolist(), best.values.tolist(), strict=True):
        assert len(e.top) == top
        assert [v for _, v in e.top] == pytest.approx(vals[:top], abs=TOL)
        assert e.top[0][0] == ids[0] or abs(vals[0] - vals[1]) < TOL  # the best token, short of a tie


@pytest.mark.parametrize("chunk", [16, 4096])
def test_every_prompt_position_scored_in_chunks_or_whole(loaded, document, reference, chunk):
    run = Run(loaded, prefill=chunk, idle=chunk)
    run.submit("echo", document, max_tokens=1, prompt_logprobs=2)
    run.drain()
    first = first_event(run, "echo")
    assert len(document) > 4 * 16  # several chunks of 16
    assert_matches(first.prompt_logprobs, document, reference, 2)
    later = [e for e in run.events if isinstance(e, Tokens) and e.request_id == "echo"][1:]
    assert all(e.prompt_logprobs is None for e in later)  # sent once


def test_cached_prefix_is_recomputed_for_prompt_logprobs(loaded, document, reference):
    run = Run(loaded, prefill=32, idle=32)
    run.submit("plain", document, max_tokens=1)
    run.drain()
    blocks = run.scheduler.blocks
    hits_before = blocks.hit_tokens
    run.submit("echo", document, max_tokens=1, prompt_logprobs=0)
    run.drain()
    assert blocks.hit_tokens == hits_before  # took no cached block
    assert_matches(first_event(run, "echo").prompt_logprobs, document, reference, 0)
    run.submit("again", document, max_tokens=1)  # and the cache still serves plain requests
    run.drain()
    assert blocks.hit_tokens > hits_before


def test_preempted_sequence_scores_each_position_once(loaded, document, reference):
    run = Run(loaded, prefill=16, idle=16)
    run.submit("echo", document, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    run.steps(3)  # a few chunks scored
    victim = run.scheduler.running[0]
    run.scheduler.preempt(victim)
    assert victim.prompt_logprobs and victim.computed == 0
    run.drain()
    assert_matches(first_event(run, "echo").prompt_logprobs, document, reference, 1)


def test_greedy_generation_logprobs_equal_the_echoed_ones(loaded, document):
    run = Run(loaded, prefill=16, idle=16)
    run.submit("gen", document, max_tokens=12, logprobs=0, ignore_eos=True)
    run.drain()
    output = run.tokens("gen")
    generated = [lp for e in run.events if isinstance(e, Tokens) and e.request_id == "gen" for lp in e.logprobs]
    run.submit("echo", document + output, max_tokens=1, prompt_logprobs=0)
    run.drain()
    echoed = first_event(run, "echo").prompt_logprobs[len(document) - 1 :]
    assert [e.token_id for e in echoed] == output
    assert [e.logprob for e in echoed] == pytest.approx([g.logprob for g in generated], abs=TOL)


def test_stop_token_logprob_reported_with_prompt_logprobs_only(loaded):
    _, tok, _, eos = loaded
    prompt = chat_ids(tok, "Say OK.")
    runs = {}
    for name, extra in (("plain", {}), ("echo", {"prompt_logprobs": 0})):
        run = Run(loaded)
        run.submit(name, prompt, max_tokens=40, logprobs=0, temperature=0.0, **extra)
        run.drain()
        runs[name] = run
    plain, echo = runs["plain"], runs["echo"]
    assert plain.finish("plain").finish_reason == "stop"  # the model ends on its end-of-turn token
    lps = {n: [lp for e in r.events if isinstance(e, Tokens) for lp in e.logprobs] for n, r in runs.items()}
    assert len(lps["plain"]) == len(plain.tokens("plain")) - 1  # the stop token left out
    assert len(lps["echo"]) == len(echo.tokens("echo"))  # one entry per token after the prompt
    assert lps["echo"][-1].token_id in eos
