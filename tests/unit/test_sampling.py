"""The batched sampler: equality with one-at-a-time sampling, seeded determinism, penalties,
bias, min_tokens, top-k/top-p, logprobs, bad rows and grammar masks (real xgrammar, real tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from worker.contract.protocol import LOGPROB_FLOOR, Grammar, SamplingParams
from worker.sampling import (
    BAD_TOKEN,
    RowSampler,
    SamplingError,
    _top_k_top_p,
    position_seed,
    sample_batch,
    sample_batch_ex,
)

CPU = torch.device("cpu")
V = 64
EOS = 2


def row(vocab: int = V, prompt=(), output=(), **kw) -> RowSampler:
    return RowSampler.from_params(
        SamplingParams(max_tokens=100, **kw), CPU, vocab, list(prompt), list(output), eos_ids={EOS}
    )


def run(samplers, logits_fn, steps: int) -> list[list[int]]:
    """Decode ``steps`` tokens for every row, accepting each; ``logits_fn(step) -> [B, V]``."""
    out = [[] for _ in samplers]
    for t in range(steps):
        toks = sample_batch(logits_fn(t), samplers)
        for s, o, tok in zip(samplers, out, toks, strict=False):
            s.accept(tok)
            o.append(tok)
    return out


def test_near_zero_temperature_is_greedy():
    logits = torch.tensor([0.0, 3.0, 1.0])
    s = RowSampler(5e-324, 1.0, 0, seed=1, device=CPU)
    assert s.greedy and s.generator is None and s.sample(logits) == 1


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0])
    for _ in range(20):
        assert RowSampler(1.0, 1.0, 1, None, CPU).sample(logits) == 1
        assert RowSampler(1.0, 0.01, 0, None, CPU).sample(logits) == 1


def test_top_p_zero_keeps_only_the_most_likely_token():
    """OpenAI's range is 0 <= top_p <= 1; 0 is greedy whatever the temperature, on the cut (top-256)
    path, the full-sort path, and with no division by zero (finite probabilities)."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        assert RowSampler(1.5, 0.0, 0, seed, CPU).sample(logits) == int(logits.argmax())
    masked = _top_k_top_p(logits.unsqueeze(0), torch.tensor([0]), torch.tensor([0.0]))
    probs = torch.softmax(masked, dim=-1)
    assert torch.isfinite(probs).all() and probs[0, int(logits.argmax())] == 1.0


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {RowSampler(1.0, 0.8, 0, seed, CPU).sample(logits) for seed in range(200)}
    assert seen == {0, 1}


def test_top_k_keeps_exactly_k_and_follows_the_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    draws = [RowSampler(1.0, 1.0, 2, seed, CPU).sample(logits) for seed in range(2000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / len(draws) - 0.4 / 0.7) < 0.05  # renormalised over the top 2


def test_unseeded_rows_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(1000, 1)
    toks = sample_batch(logits, [RowSampler(1.0, 1.0, 0, None, CPU) for _ in range(1000)])
    assert abs(toks.count(0) / 1000 - 0.7) < 0.06 and abs(toks.count(2) / 1000 - 0.1) < 0.04


def test_batched_equals_one_at_a_time():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    make = [
        lambda: row(temperature=0.0),
        lambda: row(temperature=0.8, seed=3, top_p=0.9),
        lambda: row(temperature=1.2, seed=4, top_k=5),
        lambda: row(temperature=0.7, seed=5, frequency_penalty=1.0),
        lambda: row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 3]),
        lambda: row(temperature=1.0, seed=6, logit_bias={7: 5.0}, logprobs=3),
    ]
    together = run([m() for m in make], lambda t: logits + t * 0.01, 12)
    alone = [run([m()], lambda t, i=i: (logits + t * 0.01)[i : i + 1], 12)[0] for i, m in enumerate(make)]
    assert together == alone


def test_seeded_rows_do_not_depend_on_the_batch_or_on_a_resume():
    torch.manual_seed(1)
    logits = torch.randn(4, V)

    def seeded(output=()):
        return row(temperature=0.9, seed=42, top_p=0.95, presence_penalty=0.5, output=output)

    alone = run([seeded()], lambda t: logits[:1], 20)[0]
    mixed = run(
        [seeded(), row(temperature=1.0), row(temperature=0.0), row(temperature=1.5, seed=7)], lambda t: logits, 20
    )[0]
    assert alone == mixed
    resumed = seeded(output=alone[:8])
    assert resumed.position == 8
    assert alone[:8] + run([resumed], lambda t: logits[:1], 12)[0] == alone
    assert run([row(temperature=0.9, seed=43, top_p=0.95)], lambda t: logits[:1], 20)[0] != alone


def test_position_seed_is_a_pure_function_of_seed_and_position():
    assert position_seed(5, 3) == position_seed(5, 3) != position_seed(5, 4)
    assert position_seed(-1, 0) != position_seed(2**64 - 2, 0) and 0 <= position_seed(-(2**63), 7) < 2**63


def test_frequency_and_presence_penalties_over_generated_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    s = row(temperature=0.0, frequency_penalty=0.4, prompt=[5, 5, 5])  # the prompt does not count
    assert sample_batch(logits, [s]) == [5]
    s.accept(5)
    assert sample_batch(logits, [s]) == [5]  # 1.0 - 0.4 > 0
    s.accept(5)
    assert sample_batch(logits, [s]) == [5]  # 1.0 - 0.8 > 0
    s.accept(5)
    assert sample_batch(logits, [s]) != [5]  # 1.0 - 1.2 < 0: each occurrence counts
    p = row(temperature=0.0, presence_penalty=2.0)
    p.accept(5)
    assert sample_batch(logits, [p]) != [5]  # presence counts once: 1.0 - 2.0 < 0
    free = row(temperature=0.0)
    free.accept(5)
    assert sample_batch(logits, [free]) == [5]


def test_repetition_penalty_is_hf_semantics_over_prompt_and_output():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2] + [-5.0] * (V - 4)])
    s = row(temperature=0.0, repetition_penalty=2.0, prompt=[0], logprobs=0)
    res = sample_batch_ex(logits, [s])
    assert res.token_ids == [1]  # 2.0 / 2 = 1.0 < 1.5
    s.accept(1)
    lp = torch.log_softmax(torch.tensor([1.0, 0.75, -1.0, -1.2] + [-5.0] * (V - 4)), -1)
    res = sample_batch_ex(logits, [s])
    assert res.token_ids == [0] and math.isclose(res.logprobs[0].logprob, float(lp[0]), rel_tol=1e-5)
    neg = row(temperature=0.0, repetition_penalty=2.0, prompt=[2])
    top2 = torch.tensor([[-1.0, -1.5] + [-9.0] * (V - 2)])
    top2[0, 2] = -0.9  # -0.9 * 2 = -1.8 < -1.0: a negative logit is multiplied
    assert sample_batch(top2, [neg]) == [0]


def test_logit_bias_minus_100_removes_a_token():
    logits = torch.zeros(1, V)
    logits[0, 9] = 50.0
    for seed in range(50):
        assert sample_batch(logits, [row(temperature=1.0, seed=seed, logit_bias={9: -100.0})]) != [9]
    assert sample_batch(logits, [row(temperature=0.0, logit_bias={3: 60.0})]) == [3]
    with pytest.raises(SamplingError):
        row(logit_bias={V: 1.0})


def test_min_tokens_blocks_eos_then_releases_it():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    s = row(temperature=0.0, min_tokens=2)
    assert sample_batch(logits, [s]) != [EOS]
    s.accept(4)
    assert sample_batch(logits, [s]) != [EOS]
    s.accept(4)
    assert sample_batch(logits, [s]) == [EOS]


def test_logprobs_top_matches_the_greedy_token_and_are_finite():
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    logits[1, 10:] = float("-inf")  # masked tokens are reported at the floor, never -inf
    samplers = [row(temperature=0.0, logprobs=5), row(temperature=0.0, logprobs=20)]
    res = sample_batch_ex(logits, samplers)
    for i, lp in enumerate(res.logprobs):
        assert lp.token_id == res.token_ids[i] == lp.top[0][0]
        assert all(math.isfinite(v) and v >= LOGPROB_FLOOR for _, v in lp.top)
    assert len(res.logprobs[0].top) == 5 and len(res.logprobs[1].top) == 20
    assert res.logprobs[1].top[-1][1] == LOGPROB_FLOOR
    assert sample_batch_ex(logits[:1], [row(temperature=0.0)]).logprobs == [None]
    s = samplers[0]
    s.accept(res.token_ids[0])
    assert s.take_logprobs() == [res.logprobs[0]] and s.take_logprobs() == []


def test_non_finite_rows_fail_alone():
    logits = torch.randn(3, V)
    logits[1, 4] = float("nan")
    logits[2, :] = 0.0
    samplers = [
        row(temperature=0.0),
        row(temperature=0.8, seed=1),
        row(temperature=1.0, logit_bias=dict.fromkeys(range(V), -100.0)),
    ]
    res = sample_batch_ex(logits, samplers)
    assert res.token_ids[0] == int(torch.argmax(logits[0])) and res.token_ids[1:] == [BAD_TOKEN, BAD_TOKEN]
    assert set(res.bad_rows) == {1, 2} and "finite" in res.bad_rows[1]


# ---- grammar rows, with the real tokenizer and xgrammar ------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tokenizer):
    """The shared tokenizer, with grammar support configured for it in this process."""
    from worker import grammar

    grammar.configure(tokenizer, 49152, {tokenizer.eos_token_id})
    return tokenizer


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def test_grammar_rows_produce_valid_json_and_end_on_eos(tokenizer):
    spec = Grammar(kind="json_schema", source=json.dumps(SCHEMA))
    torch.manual_seed(3)
    vocab = 49152
    eos = tokenizer.eos_token_id
    samplers = [
        RowSampler.from_params(
            SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=spec), CPU, vocab, [1], [], eos_ids={eos}
        )
        for s in range(3)
    ]
    samplers.append(
        RowSampler.from_params(
            SamplingParams(max_tokens=200, temperature=1.0, seed=9), CPU, vocab, [1], [], eos_ids={eos}
        )
    )
    outs = [[] for _ in samplers]
    for _ in range(200):
        toks = sample_batch(torch.randn(len(samplers), vocab), samplers)
        for s, o, t in zip(samplers, outs, toks, strict=False):
            if o and o[-1] == eos:
                continue
            s.accept(t)
            o.append(t)
        if all(o and o[-1] == eos for o in outs[:3]):
            break
    for o in outs[:3]:
        assert o[-1] == eos
        value = json.loads(tokenizer.decode(o[:-1]))
        assert set(value) == {"name", "tags"} and len(value["name"]) <= 8 and len(value["tags"]) <= 3
    # a resumed grammar row continues from the replayed prefix
    half = outs[0][:5]
    again = RowSampler.from_params(
        SamplingParams(max_tokens=200, temperature=1.0, seed=0, grammar=spec), CPU, vocab, [1], half, eos_ids={eos}
    )
    assert again.position == 5 and not again.grammar.terminated


def test_grammar_json_object_and_terminated_row_is_bad(tokenizer):
    eos = tokenizer.eos_token_id
    s = RowSampler.from_params(
        SamplingParams(max_tokens=50, temperature=0.0, grammar=Grammar(kind="json_object")),
        CPU,
        49152,
        [1],
        [],
        eos_ids={eos},
    )
    for t in tokenizer("{}", add_special_tokens=False)["input_ids"]:
        s.accept(t)
    logits = torch.zeros(1, 49152)
    assert sample_batch(logits, [s]) == [eos]  # the value is complete: only the stop token is allowed
    s.accept(eos)
    res = sample_batch_ex(logits, [s])
    assert res.token_ids == [BAD_TOKEN] and 0 in res.bad_rows


def test_greedy_fast_path_equals_the_general_path_bitwise():
    """A step of plain greedy rows takes one ``max``; tokens and bad rows are the general path's,
    ties (the first maximum), NaN, +inf and an all ``-inf`` row included."""
    from worker.sampling import _general, _greedy

    torch.manual_seed(0)
    logits = torch.randn(6, V)
    logits[1, 4] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :] = 1.0  # a tie over the whole row
    logits[5, 9] = logits[5, 11] = 50.0  # a tie between two tokens
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        greedy = [row(temperature=0.0) for _ in range(6)]
        fast, slow = _greedy(x, greedy), _general(x, greedy)
        assert fast.token_ids == slow.token_ids and fast.bad_rows == slow.bad_rows
        assert fast.logprobs == slow.logprobs == [None] * 6
        assert set(fast.bad_rows) == {1, 2, 3} and fast.token_ids[4] == 0 and fast.token_ids[5] == 9
    # rows that need more than the argmax take the general path through sample_batch_ex
    mixed = [row(temperature=0.0), row(temperature=0.0, logprobs=2), row(temperature=0.0, logit_bias={9: -100})]
    res = sample_batch_ex(logits[[0, 0, 5]], mixed)
    assert res.logprobs[1] is not None and res.token_ids[2] == 11


@pytest.mark.parametrize("rows", [1, 3])
def test_row_max_is_torch_max_first_index_nan_and_ties(rows):
    """The two-level maximum: torch.max's values and first indices, over ties, NaN and infinities."""
    from worker.sampling import CHUNK, row_max

    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        x = torch.randn(rows, CHUNK * 7, generator=g)
        if trial % 2:
            x = x.round()  # many ties, within and across chunks
        if trial % 5 == 1:
            x[0, 3 * CHUNK + 5] = x[-1, 2] = float("nan")
        if trial % 7 == 2:
            x[-1, :] = float("-inf")
        if trial % 11 == 3:
            x[0, 6 * CHUNK] = x[0, CHUNK + 1] = float("inf")
        got, want = row_max(x), torch.max(x, dim=-1)
        torch.testing.assert_close(got[0], want.values, equal_nan=True, atol=0, rtol=0)
        assert torch.equal(got[1], want.indices), trial
    odd = torch.randn(rows, CHUNK + 3, generator=g)  # not a multiple of the chunk: torch.max itself
    assert torch.equal(row_max(odd)[1], odd.argmax(-1))
