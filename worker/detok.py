"""Incremental detokenization and stop-string matching for one sequence.

``IncrementalDetokenizer`` follows the prefix/read-offset scheme of TGI and vLLM
(``decode_token`` in text-generation-inference): decode a small window of recent tokens and emit
only the new suffix, holding it back while it ends in U+FFFD, so a multi-byte UTF-8 character
split across tokens is never emitted in halves.

``StopMatcher`` finds stop strings in the generated text, even across token boundaries, and holds
back any tail that could still grow into a stop string, so the client never sees part of one.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas of whole characters.

    ``add(token_id) -> str`` returns the newly completed text (possibly ``""``).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: list[int] | None = None):
        self._tok = tokenizer
        # A few prompt tokens give the decoder the right context for leading spaces.
        self._ids: list[int] = list(prompt_tail or [])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""


class StopMatcher:
    """Applies stop strings to a text stream.

    ``feed(delta) -> (safe_text, stopped)``: ``safe_text`` may be sent now; when ``stopped`` is
    true the text up to (not including) the stop string has been returned and generation must end.
    ``flush()`` returns the held-back tail at the end of a sequence that did not stop.
    """

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
