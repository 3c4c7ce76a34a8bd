"""Responses output items, built from the chat choice chunks of :class:`router.shaping.Choice`.

One builder serves both modes: streamed, the events it returns are sent as they come; not
streamed, the whole answer arrives as one event and only :attr:`OutputBuilder.items` is used, so
both give the same items for the same answer.

Text becomes a ``message`` item with one ``output_text`` part (``annotations: []``, ``logprobs``
in OpenAI's shape when asked, else ``[]``); each tool call becomes a ``function_call`` item (its
own ``id``, the chat call's id as ``call_id``, ``arguments`` a JSON string). A message is opened
only once visible text arrives, so the whitespace a model writes before a tool call does not make
an empty message; an answer with no text and no call is one message with an empty text.

Events (without ``sequence_number``, which the writer adds): ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done``, ``response.output_item.done``; for calls
``response.output_item.added``, ``response.function_call_arguments.delta`` ... ``.done``,
``response.output_item.done``. The items inside events are snapshots, as OpenAI sends them.
"""

from __future__ import annotations

import copy
import uuid


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Feed it every chunk of one chat choice, in order; read :attr:`items` after the last."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being built (the last of ``items``)
        self.pending = ""  # whitespace held until it turns out to start a message
        self.pending_lps: list[dict] = []
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self.finished = False

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def feed(self, chunks: list[dict]) -> list[dict]:
        """The events for these chat choice chunks (``{"delta", "logprobs", "finish_reason"}``)."""
        events: list[dict] = []
        for chunk in chunks:
            delta = chunk.get("delta") or {}
            lps = (chunk.get("logprobs") or {}).get("content") or []
            text = delta.get("content") or ""
            if text or lps:
                events += self._text(text, lps)
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if chunk.get("finish_reason") is not None:
                events += self._finish("incomplete" if chunk["finish_reason"] == "length" else "completed")
        return events

    def _text(self, text: str, lps: list[dict]) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.open["type"] != "message":
            if not (self.pending + text).strip():
                self.pending += text
                self.pending_lps += lps
                return []
            events += self._close("completed") + self._open_message()
            text, lps = self.pending + text, self.pending_lps + lps
            self.pending, self.pending_lps = "", []
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += lps
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": self.open["id"],
                "output_index": self.index,
                "content_index": 0,
                "delta": text,
                "logprobs": lps,
            }
        )
        return events

    def _open_message(self) -> list[dict]:
        item = {
            "id": new_item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(item)
        self.open = item
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        added = {"type": "response.output_item.added", "output_index": self.index, "item": {**item, "content": []}}
        return [
            added,
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": self.index,
                "content_index": 0,
                "part": copy.deepcopy(part),
            },
        ]

    def _call(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        fn = delta.get("function") or {}
        if "id" in delta:  # the head of a new call
            events += self._close("completed")
            item = {
                "id": new_item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": delta["id"],
                "name": fn.get("name", ""),
            }
            self.items.append(item)
            self.open = self.calls[delta["index"]] = item
            events.append({"type": "response.output_item.added", "output_index": self.index, "item": dict(item)})
        item = self.calls.get(delta.get("index", 0))
        fragment = fn.get("arguments") or ""
        if item is not None and fragment:
            item["arguments"] += fragment
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": self.items.index(item),
                    "delta": fragment,
                }
            )
        return events

    def _close(self, status: str) -> list[dict]:
        """Finish the open item (``completed`` or ``incomplete``) with its ``.done`` events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            head = {"item_id": item["id"], "output_index": at, "content_index": 0}
            events = [
                {"type": "response.output_text.done", **head, "text": part["text"], "logprobs": part["logprobs"]},
                {"type": "response.content_part.done", **head, "part": copy.deepcopy(part)},
            ]
        else:
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": at,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            ]
        return [*events, {"type": "response.output_item.done", "output_index": at, "item": copy.deepcopy(item)}]

    def _finish(self, status: str) -> list[dict]:
        events: list[dict] = []
        if not self.items:  # an answer of nothing (or only whitespace) is still a message
            events += self._open_message()
            if self.pending or self.pending_lps:
                events += self._text(self.pending, self.pending_lps)
        self.pending, self.pending_lps = "", []
        self.finished = True
        return events + self._close(status)
