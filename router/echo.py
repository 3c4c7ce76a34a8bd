"""``echo`` on ``/v1/completions``: the prompt given back before the completion, and with ``logprobs``
the prompt's tokens scored before the completion's, as OpenAI's legacy completions and vLLM return
them; how lm-evaluation-harness's ``local-completions`` loglikelihood tasks and perplexity scripts
read a model's probabilities over a text.

* ``text`` is the prompt's text (as sent; a token-id prompt decoded) followed by the completion's.
* ``logprobs.tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` cover the prompt's
  tokens first — the first one with ``null`` logprob and ``null`` top_logprobs, since nothing
  predicts it — then the completion's. The prompt's values come from the worker
  (``SamplingParams.prompt_logprobs``, :mod:`worker.prompt_logprobs`): the model's raw distribution,
  where a completion token's is after penalties and bias (the same with neither). With echo a
  generation that ends on the stop token reports that token too (one entry per token after the
  prompt, as vLLM does), so a scorer that drops the last entry keeps exactly the prompt's.
* ``max_tokens: 0`` returns the prompt alone (``finish_reason: "length"``, no completion tokens):
  the worker is asked for one token, which is dropped, as vLLM does.
* Streamed, the prompt's text and logprobs come in the choice's first chunk (vLLM's behaviour).
"""

from __future__ import annotations

import msgspec

from router.shaping import Choice, TokenTexts
from worker.contract.protocol import TokenLogprob, Tokens, Usage


def prompt_logprobs_object(
    texts: TokenTexts, prompt: list[int], entries: list[TokenLogprob] | None, top: int
) -> tuple[dict, int]:
    """The ``text_completion`` logprobs object of the prompt's tokens (``entries``: tokens 1..P-1's,
    from the worker; ``None`` reports every value as null) and the offset after their text."""
    first = texts.text(prompt[0])
    out: dict = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    if entries is None or len(entries) != len(prompt) - 1:
        offset = len(first)
        for t in prompt[1:]:
            text = texts.text(t)
            for key, value in (("tokens", text), ("token_logprobs", None), ("top_logprobs", None)):
                out[key].append(value)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset
    rest, offset = texts.completion(entries, top, len(first))
    return join(out, rest), offset


def join(a: dict | None, b: dict | None) -> dict | None:
    """Two logprobs objects one after the other."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


class EchoChoice(Choice):
    """A completions choice with ``echo`` (see the module docstring). ``prompt_text`` is what the
    choice's text starts with, ``prompt`` its token ids; ``generate=False`` for ``max_tokens: 0``."""

    def __init__(
        self,
        index: int,
        texts: TokenTexts | None,
        top_logprobs: int | None,
        prompt_text: str,
        prompt: list[int],
        generate: bool,
    ):
        super().__init__(index, False, None, texts, top_logprobs)
        self.prompt_text, self.prompt, self.generate = prompt_text, prompt, generate
        self.head: dict | None = None  # the prompt's logprobs object
        self.echoed = False

    def _prompt_only(self, tok: Tokens) -> Tokens:
        """The worker's event for ``max_tokens: 0``: its one generated token dropped."""
        n = len(self.prompt)
        return msgspec.structs.replace(
            tok,
            text_delta="",
            token_ids=[],
            logprobs=[] if tok.logprobs is not None else None,
            finish_reason="length" if tok.finish_reason is not None else None,
            usage=Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n) if tok.usage is not None else None,
        )

    def feed(self, tok: Tokens) -> list[dict]:
        if not self.generate:
            tok = self._prompt_only(tok)
        if self.echoed:
            return super().feed(tok)
        self.echoed = True
        if self.top is not None and self.texts is not None:
            self.head, _ = prompt_logprobs_object(self.texts, self.prompt, tok.prompt_logprobs, self.top)
        self.offset = len(self.prompt_text)  # the completion's offsets count from the end of the echo
        out = super().feed(tok)
        self.parts.insert(0, self.prompt_text)
        if not out:
            return [{"index": self.index, "text": self.prompt_text, "logprobs": self.head, "finish_reason": None}]
        out[0] = {**out[0], "text": self.prompt_text + out[0]["text"], "logprobs": join(self.head, out[0]["logprobs"])}
        return out

    def whole(self) -> dict:
        out = super().whole()
        if self.top is not None and self.texts is not None:
            completion, _ = self.texts.completion(self.lps, self.top, len(self.prompt_text))
            out["logprobs"] = join(self.head, completion)
        return out
