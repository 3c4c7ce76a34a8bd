"""Response objects exactly as OpenAI's API reference publishes them: ``chat.completion``,
``chat.completion.chunk`` and ``text_completion``, with ``n`` choices, tool calls and logprobs.

Every field the reference marks required is present, ``null`` where empty: ``message.refusal``,
``choices[].logprobs``, ``delta`` objects in chunks, ``usage: null`` on the chunks before the last
when ``stream_options.include_usage`` is set.

Logprobs are natural logs. A token the sampler had masked (top-k, grammar, a -100 bias) has a
log-probability of -inf, which JSON cannot carry: it is reported as ``LOGPROB_FLOOR`` (-9999.0).
A token's ``token`` is its text (its bytes decoded as UTF-8, with U+FFFD for a partial character),
``bytes`` its exact bytes.
"""

from __future__ import annotations

import time

from router.tools import Call, CallStreamer, ToolMode, parse_calls
from worker.contract.protocol import TokenLogprob, Tokens


class TokenTexts:
    """Each token id's bytes, from xgrammar's decoded vocabulary of the router's tokenizer."""

    def __init__(self, vocab_bytes: list[bytes]):
        self.vocab = vocab_bytes

    def bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id] if 0 <= token_id < len(self.vocab) else b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}

    def chat(self, lps: list[TokenLogprob], top: int) -> list[dict]:
        """``choices[].logprobs.content`` entries."""
        return [
            {
                **self.chat_entry(lp.token_id, lp.logprob),
                "top_logprobs": [self.chat_entry(t, v) for t, v in lp.top[:top]],
            }
            for lp in lps
        ]

    def completion(self, lps: list[TokenLogprob], top: int, offset: int) -> tuple[dict, int]:
        """The ``text_completion`` logprobs object of these tokens, their text starting at character
        ``offset`` of the completion; returns it and the offset after them."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            alts: dict[str, float] = {}
            for t, v in lp.top[:top]:
                alts.setdefault(self.text(t), v)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset


class Choice:
    """One choice of a response, fed the worker's events in order.

    ``feed(tok)`` returns the stream choice objects to send for it (``[]`` when nothing is to be
    sent yet); after the last event, :meth:`whole` is the non-streaming choice object.
    """

    def __init__(
        self, index: int, chat: bool, tools: ToolMode | None, texts: TokenTexts | None, top_logprobs: int | None
    ):
        self.index, self.chat = index, chat
        self.tools = tools
        self.texts = texts
        self.top = top_logprobs  # None: no logprobs asked
        self.parts: list[str] = []
        self.lps: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.usage = None
        self.streamer = CallStreamer(tools) if tools is not None else None
        self.calls: list[Call] = []
        self.offset = 0
        self.started = False

    def _lp(self, lps: list[TokenLogprob]) -> dict | None:
        if self.top is None or self.texts is None:
            return None
        if self.chat:
            return {"content": self.texts.chat(lps, self.top), "refusal": None}
        out, self.offset = self.texts.completion(lps, self.top, self.offset)
        return out

    def _chunk(self, delta: dict | str, lps: list[TokenLogprob] | None, finish: str | None) -> dict:
        logprobs = self._lp(lps) if lps else None
        if self.chat:
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": self.index, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    def _text_and_calls(self, tok: Tokens) -> tuple[str, list]:
        """The event's text to relay and the tool calls it completed (the tool-call parser holds
        back call markup); at the finish, what the parser held and this choice's finish reason."""
        text, calls = tok.text_delta, []
        if self.streamer is not None:
            text, calls = self.streamer.feed(tok.text_delta)
        if tok.finish_reason is not None:
            self.finish_reason, self.usage = tok.finish_reason, tok.usage
            if self.streamer is not None:
                rest, more, self.calls = self.streamer.finish()
                text, calls = text + rest, calls + more
                if self.calls and self.finish_reason == "stop":
                    self.finish_reason = "tool_calls"
        return text, calls

    def feed(self, tok: Tokens) -> list[dict]:
        lps = list(tok.logprobs or [])
        self.parts.append(tok.text_delta)
        self.lps += lps
        out: list[dict] = []
        if self.chat and not self.started:
            self.started = True
            out.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        text, calls = self._text_and_calls(tok)
        if not self.chat:
            if text or lps or tok.finish_reason:
                out.append(self._chunk(text, lps, self.finish_reason))
            return out
        if text or lps:
            out.append(self._chunk({"content": text}, lps, None))
        if calls:
            out.append(self._chunk({"tool_calls": calls}, None, None))
        if tok.finish_reason is not None:
            out.append(self._chunk({}, None, self.finish_reason))
        return out

    def whole(self) -> dict:
        text = "".join(self.parts)
        if not self.chat:
            logprobs = self.texts.completion(self.lps, self.top, 0)[0] if self.top is not None and self.texts else None
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        finish = self.finish_reason
        message: dict = {"role": "assistant", "content": text, "refusal": None}
        if self.tools is not None:
            content, calls = parse_calls(text, self.tools)
            if calls:
                message["content"] = content
                message["tool_calls"] = [c.as_dict() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        logprobs = (
            {"content": self.texts.chat(self.lps, self.top), "refusal": None}
            if self.top is not None and self.texts is not None
            else None
        )
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}


class Shaper:
    """The envelope of every response object: ``id``, ``object``, ``created``, ``model``,
    ``system_fingerprint`` (:mod:`worker.contract.fingerprint`: a ready replica's until
    :meth:`served_by` names the one whose tokens the answer carries)."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool = False, fingerprint: str = ""):
        self.chat = chat
        self.include_usage = include_usage
        self.base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
        }

    def served_by(self, fingerprint: str) -> None:
        """The fingerprint of the worker that produced the tokens (from then on, in every chunk)."""
        if fingerprint:
            self.base["system_fingerprint"] = fingerprint

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict]) -> dict:
        out = {**self.base, "object": self.chunk_object, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.base, "object": self.chunk_object, "choices": [], "usage": usage}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {
            **self.base,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": choices,
            "usage": usage,
        }


def total_usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    """OpenAI counts the prompt once and the completion tokens of every choice."""
    completion = sum(c.usage.completion_tokens for c in choices if c.usage is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(choices)},
    }


def cached_tokens(choices: list[Choice]) -> int:
    """Prompt tokens the worker found in its prefix cache: the most any choice's worker found
    (the prompt is counted once, as in ``prompt_tokens``)."""
    return max((c.usage.cached_tokens for c in choices if c.usage is not None), default=0)
