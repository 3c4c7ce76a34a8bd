"""Tool calling: the tools into the prompt, the grammar of a forced call, the calls out of the text.

Prompt. When the model's chat template uses ``tools`` itself, the tools and the history go to it
as they are (assistant ``tool_calls`` with their arguments parsed to objects, ``role: "tool"``
messages unchanged). Otherwise (SmolLM2's template, for one) they are rendered in the Hermes
format that Qwen2.5 and NousResearch's models were trained on:

* the system turn gains ``TOOLS_PROMPT`` with one JSON line per tool between ``<tools>`` tags;
* an assistant turn's earlier calls become ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  lines after its text;
* a ``role: "tool"`` message becomes a user turn ``<tool_response>{content}</tool_response>``.

Output. ``tool_choice: "required"`` or a named function constrains decoding to exactly one call,
``{"name": "<function>", "arguments": <valid against the function's parameters>}`` (a grammar;
``parallel_tool_calls`` has no effect there); ``"auto"`` (the default with tools) leaves the model
free and :func:`parse_calls` takes every ``<tool_call>...</tool_call>`` block (or a whole answer
that is such an object) naming a known function; ``"none"`` renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from router.errors import ApiError
from router.schemas import ChatRequest, NamedToolChoice
from router.structured import check_schema
from worker.contract.protocol import Grammar

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def template_has_tools(tokenizer) -> bool:
    """The chat template reads a ``tools`` variable (it renders tools itself)."""
    tpl = getattr(tokenizer, "chat_template", None)
    tpl = tpl if isinstance(tpl, str) else json.dumps(tpl)
    return bool(tpl) and re.search(r"\btools\b", tpl) is not None


@dataclass
class ToolMode:
    """How a request's output relates to its tools: ``choice`` is ``auto``, ``required`` or a
    function name (forced); ``names`` the functions offered."""

    choice: str
    names: list[str]
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def tool_mode(req: ChatRequest) -> ToolMode | None:
    """``None`` when the output is plain text (no tools, or ``tool_choice: "none"``)."""
    if not req.tools or req.tool_choice == "none":
        return None
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    return ToolMode(choice=choice, names=[t.function.name for t in req.tools], parallel=req.parallel_tool_calls)


def tool_grammar(req: ChatRequest, mode: ToolMode) -> Grammar:
    """The grammar of one forced call: an object with the function's ``name`` then its ``arguments``
    (an ``anyOf`` over the tools for ``required``). The parameter schemas are checked (400 ``tools``)."""
    options, defs = [], {}
    for t in req.tools:
        if mode.choice not in ("required", t.function.name):
            continue
        params = t.function.parameters if t.function.parameters is not None else {"type": "object"}
        check_schema(params, "tools")
        params = _hoist_definitions(params, defs)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), **defs}
    # The grammar writes properties in the schema's order: "name" comes before "arguments", so a
    # stream announces the call before its arguments (and a call cut by max_tokens still names its
    # function), and the arguments follow the order of the function's parameters.
    return Grammar(kind="json_schema", source=check_schema(schema, "tools"), strict=True)


def _hoist_definitions(params: dict, defs: dict) -> dict:
    """``params`` without its ``$defs`` / ``definitions``, which move into ``defs`` (the call
    grammar's root): a ``$ref`` such as ``#/$defs/Address`` (Pydantic, Spring AI) resolves against
    the root of the schema compiled, where the parameters are nested. Raises a 400 when two tools
    define one name differently."""
    if not isinstance(params, dict):
        return params
    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                raise ApiError(
                    400, f"tools: two functions define {key}/{name} differently", param="tools", code="invalid_schema"
                )
    return {k: v for k, v in params.items() if k not in ("$defs", "definitions")}


def chat_messages(req: ChatRequest, native: bool) -> tuple[list[dict], dict]:
    """The messages for ``apply_chat_template`` and its extra keyword arguments (``tools`` when the
    template renders them, ``native``)."""
    offered = req.tools if req.tools and req.tool_choice != "none" else None
    out = [_native_message(m) if native else _hermes_message(m) for m in req.messages]
    kwargs: dict = {}
    if offered and native:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in offered]
    elif offered:
        listing = TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in offered)
        )
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}" if out[0]["content"] else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, kwargs


def _native_message(m) -> dict:
    """One message for a template that renders tool calls and tool results itself."""
    role = "system" if m.role == "developer" else m.role
    msg: dict = {"role": role, "content": m.text()}
    if m.tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None and role == "tool":
        msg["name"] = m.name
    return msg


def _hermes_message(m) -> dict:
    """One message in the Hermes convention, for a template that knows no tools: calls as
    ``<tool_call>`` blocks in the text, a tool's result as a user turn in ``<tool_response>``."""
    role = "system" if m.role == "developer" else m.role
    text = m.text()
    if m.tool_calls:
        calls = "\n".join(
            f"{OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _loads(c.function.arguments)}, ensure_ascii=False)}\n{CLOSE}"
            for c in m.tool_calls
        )
        text = f"{text}\n{calls}" if text else calls
    if role == "tool":
        role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
    return {"role": role, "content": text}


def _loads(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or new_call_id()

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, names: list[str]) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _call_in(text: str, names: list[str]) -> Call | None:
    """The call ``text`` holds as JSON (``{"name": ..., "arguments": ...}``), or None."""
    try:
        return _call(json.loads(text), names)
    except ValueError:
        return None


def parse_calls(text: str, mode: ToolMode) -> tuple[str | None, list[Call]]:
    """``(content, calls)`` from a finished answer. Forced: the whole text is the call. Auto: every
    ``<tool_call>`` block naming a known function (the first only without ``parallel_tool_calls``);
    the text outside the blocks is the content (``None`` when empty). No call found: the text is
    the content."""
    if mode.forced:
        call = _call_in(text, mode.names)
        return (None, [call]) if call else (text, [])
    calls = [call for m in _BLOCK.finditer(text) if (call := _call_in(m.group(1), mode.names))]
    if not calls:
        stripped = text.strip()
        call = _call_in(stripped, mode.names) if stripped.startswith("{") else None
        return (None, [call]) if call else (text, [])
    if not mode.parallel:
        calls = calls[:1]
    rest = _BLOCK.sub("", text).strip()
    return rest or None, calls


_FORCED_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class CallStreamer:
    """Turns a streamed answer into OpenAI tool-call deltas.

    Forced mode: once ``{"name": "f", "arguments": `` has arrived, one delta carries ``index``,
    ``id``, ``type`` and ``function.name`` (``arguments: ""``), then each text delta's argument
    fragment follows (the final ``}`` of the wrapper is held back and dropped). Auto mode: text is
    content until a ``<tool_call>`` tag starts (a tail that could be the tag's beginning is held
    back); from there the rest is held and :meth:`finish` parses it, sending each call as an id+name
    delta then its arguments in one fragment.
    """

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""  # everything received
        self.sent = 0  # forced: characters of argument text sent; auto: characters sent as content
        self.call: Call | None = None
        self.in_call = False
        self.calls: list[Call] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """``(content_delta, tool_call_deltas)`` to send now."""
        self.text += delta
        if self.mode.forced:
            return "", self._forced()
        if self.in_call:
            return "", []
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent : at], at
            return out, []
        keep = next(
            (n for n in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1) if self.text.endswith(OPEN[:n])), 0
        )
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out, []

    def _forced(self) -> list[dict]:
        out = []
        if self.call is None:
            m = _FORCED_HEAD.match(self.text)
            if not m:
                return []
            self.call = Call(json.loads(f'"{m.group(1)}"'), "")
            self.sent = m.end()
            out.append(
                {
                    "index": 0,
                    "id": self.call.id,
                    "type": "function",
                    "function": {"name": self.call.name, "arguments": ""},
                }
            )
        end = len(self.text) - 1  # the last character may be the wrapper's closing brace
        if end > self.sent:
            out.append({"index": 0, "function": {"arguments": self.text[self.sent : end]}})
            self.sent = end
        return out

    def finish(self) -> tuple[str, list[dict], list[Call]]:
        """At the end: ``(content_delta, tool_call_deltas, calls)`` still to send."""
        if self.mode.forced:
            _, calls = parse_calls(self.text, self.mode)
            if self.call is None:
                return (
                    (self.text, [], [])
                    if not calls
                    else ("", [_head(0, calls[0]), _args(0, calls[0].arguments)], calls)
                )
            tail = self.text[self.sent :].rstrip()
            tail = tail[:-1] if tail.endswith("}") else tail
            deltas = [{"index": 0, "function": {"arguments": tail}}] if tail else []
            if calls:
                calls[0].id = self.call.id
            return "", deltas, calls or [self.call]
        if not self.in_call:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, [], []
        _, calls = parse_calls(self.text, self.mode)
        if not calls:
            return self.text[self.sent :], [], []
        deltas = []
        for i, c in enumerate(calls):
            deltas += [_head(i, c), _args(i, c.arguments)]
        return "", deltas, calls


def _head(i: int, c: Call) -> dict:
    return {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}


def _args(i: int, arguments: str) -> dict:
    return {"index": i, "function": {"arguments": arguments}}
