"""``echo`` on completions (router.echo): the prompt before the completion, in text and logprobs,
streamed or whole, and ``max_tokens: 0``; every body validates as the ``openai`` SDK's types."""

from __future__ import annotations

import copy

from openai.types import Completion

from router.echo import EchoChoice
from router.shaping import Shaper, TokenTexts, total_usage
from worker.contract.protocol import TokenLogprob, Tokens, Usage

VOCAB = [b"The", b" cat", b" sat", b".", b"<eos>"]
PROMPT = [0, 1, 2]  # "The cat sat"


def lp(t: int, v: float) -> TokenLogprob:
    return TokenLogprob(token_id=t, logprob=v, top=[(t, v), (4, -9.0)])


PROMPT_LPS = [lp(1, -2.0), lp(2, -3.0)]  # tokens 1..P-1


def events() -> list[Tokens]:
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    return [
        Tokens(request_id="r", text_delta=".", token_ids=[3], logprobs=[lp(3, -0.5)], prompt_logprobs=PROMPT_LPS),
        Tokens(
            request_id="r",
            text_delta="",
            token_ids=[4],
            logprobs=[lp(4, -0.1)],
            finish_reason="stop",
            usage=usage,
        ),
    ]


def sdk(body: dict) -> Completion:
    """The body as the SDK's type. OpenAI sends ``null`` for the first prompt token's logprob and
    top_logprobs, which the SDK's annotations do not allow (its client builds responses without
    validating, so it parses them): validate the rest, then read the body itself for the nulls."""
    body = copy.deepcopy(body)
    for c in body["choices"]:
        lps = c["logprobs"]
        if lps and lps["token_logprobs"] and lps["token_logprobs"][0] is None:
            lps["token_logprobs"][0], lps["top_logprobs"][0] = 0.0, {}
    return Completion.model_validate(body)


def whole(choice: EchoChoice) -> tuple[dict, list[dict]]:
    """Feed the events; returns the whole body and the stream chunks fed along the way."""
    chunks = []
    for e in events():
        chunks += choice.feed(e)
    return Shaper("x", "m", chat=False).whole([choice.whole()], total_usage(3, [choice])), chunks


def test_echo_with_logprobs_prompt_first_then_completion():
    body, chunks = whole(EchoChoice(0, TokenTexts(VOCAB), 1, "The cat sat", PROMPT, generate=True))
    parsed = sdk(body)
    c = body["choices"][0]
    assert c["text"] == "The cat sat."
    assert c["logprobs"]["tokens"] == ["The", " cat", " sat", ".", "<eos>"]
    assert c["logprobs"]["token_logprobs"] == [None, -2.0, -3.0, -0.5, -0.1]
    assert c["logprobs"]["top_logprobs"] == [None, {" cat": -2.0}, {" sat": -3.0}, {".": -0.5}, {"<eos>": -0.1}]
    assert c["logprobs"]["text_offset"] == [0, 3, 7, 11, 12]
    assert parsed.usage.prompt_tokens == 3 and parsed.usage.completion_tokens == 2
    # streamed: the first chunk carries the prompt's text and logprobs with the first token's
    first = chunks[0]
    assert first["text"] == "The cat sat." and first["logprobs"]["token_logprobs"] == [None, -2.0, -3.0, -0.5]
    assert chunks[-1]["logprobs"]["text_offset"] == [12] and chunks[-1]["finish_reason"] == "stop"
    sdk(Shaper("x", "m", chat=False).whole([chunks[-1]], total_usage(3, [])))


def test_max_tokens_zero_returns_the_prompt_alone():
    choice = EchoChoice(0, TokenTexts(VOCAB), 0, "The cat sat", PROMPT, generate=False)
    body, chunks = whole(choice)
    assert sdk(body).choices[0].finish_reason == "length"
    c = body["choices"][0]
    assert c["text"] == "The cat sat"
    assert c["logprobs"]["token_logprobs"] == [None, -2.0, -3.0] and c["logprobs"]["top_logprobs"] == [None, {}, {}]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 0,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert [ch["text"] for ch in chunks] == ["The cat sat", ""] and chunks[-1]["finish_reason"] == "length"


def test_echo_without_logprobs_is_text_only():
    body, chunks = whole(EchoChoice(0, None, None, "The cat sat", PROMPT, generate=True))
    assert body["choices"][0]["text"] == "The cat sat." and body["choices"][0]["logprobs"] is None
    assert chunks[0]["text"] == "The cat sat." and chunks[0]["logprobs"] is None


def test_missing_prompt_logprobs_are_null_not_shifted():
    choice = EchoChoice(0, TokenTexts(VOCAB), 1, "The cat sat", PROMPT, generate=False)
    choice.feed(Tokens(request_id="r", text_delta="", token_ids=[3], finish_reason="length"))
    lps = choice.whole()["logprobs"]
    assert lps["tokens"] == ["The", " cat", " sat"] and lps["token_logprobs"] == [None, None, None]


def test_prompt_logprobs_survive_a_migration_once():
    """A worker lost after the first delta: the next one scores the prompt again (it recomputes it
    anyway); the client gets the first copy only, streamed or buffered."""
    import asyncio

    from router.generation import stream_tokens
    from tests.helpers.router_pool import collect, run, step, two_workers
    from worker.contract.protocol import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, prompt_logprobs=0)

    def say(pool, ids, first=False, finish=None):
        """The latest attempt's worker sends one delta; its first carries the prompt's logprobs."""
        wid, gen = pool.generates()[-1]
        usage = Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6) if finish else None
        pool.frame(
            wid,
            Tokens(
                request_id=gen.request_id,
                text_delta="x",
                token_ids=ids,
                logprobs=[lp(i, -1.0) for i in ids],
                prompt_logprobs=PROMPT_LPS if first else None,
                finish_reason=finish,
                usage=usage,
            ),
        )

    for buffered in (False, True):

        async def scenario(buffered=buffered):
            pool = two_workers()
            task = asyncio.create_task(
                collect(stream_tokens(pool, PROMPT, params, max_retries=0, max_migrations=1, buffered=buffered))
            )
            await step()
            say(pool, [3], first=True)
            await step()
            pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
            await step()
            gen = pool.generates()[1][1]
            assert gen.params.prompt_logprobs == 0 and gen.output_token_ids == [3]
            say(pool, [4], first=True)  # the new worker's first delta: the prompt's logprobs again
            say(pool, [5], finish="length")
            return await task

        events = run(scenario())
        sent = [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]
        assert sent == [PROMPT_LPS]
        assert [lp.token_id for e in events for lp in e.logprobs] == [3, 4, 5]
