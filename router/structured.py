"""Structured output on the router side: ``response_format`` (and forced tool calls) to a
:class:`worker.contract.protocol.Grammar`, checked and compiled here before any worker sees it.

A schema is refused with a 400 (``param: "response_format"``, or ``"tools"`` for a function's
``parameters``) when it is over ``MAX_SCHEMA_BYTES`` of compact JSON, nested deeper than
``MAX_DEPTH``, not a schema (``"properties": {"foo": "bar"}``), has a count keyword over
``MAX_COUNT`` (``minItems: 100000000`` would force a value no ``max_tokens`` can hold), a
``pattern`` that is not a valid regular expression (``foo**``), or when xgrammar cannot compile it
within ``COMPILE_TIMEOUT_S``. The compile runs on a small thread pool, off the event loop (xgrammar
releases the GIL while compiling); grammars that compiled are remembered (bounded LRU), so a
repeated schema costs a dictionary lookup. The worker compiles the same source again for its own
vocabulary (:mod:`worker.grammar`): the check here bounds what that costs.

The grammar is compiled from the schema with its keys in the order the client sent them: xgrammar
writes an object's properties in the order of ``properties``, and OpenAI's structured outputs follow
the schema's order (a ``reasoning`` field placed before ``answer`` is generated first). Both caches
are keyed by that text, so two schemas that differ only in key order never share a grammar.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.errors import ApiError
from worker.contract.protocol import Grammar

log = logging.getLogger(__name__)

MAX_SCHEMA_BYTES = 64 * 1024
MAX_DEPTH = 64
MAX_COUNT = 10_000
COMPILE_TIMEOUT_S = 5.0
CACHE_ENTRIES = 1024
COUNT_KEYWORDS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_ONES = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


def compact(schema: Any) -> str:
    """The schema as compact JSON (no spaces) with its keys in the client's order: the grammar's
    source and the cache key on both sides (sorting the keys would reorder the generated object)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(schema: Any, param: str = "response_format") -> str:
    """Structural checks of a JSON schema; returns it as :func:`compact` JSON, keys in the client's
    order. Raises a 400 :class:`ApiError`."""
    if not isinstance(schema, (dict, bool)):
        raise _bad(param, "the JSON schema must be an object")
    try:
        text = compact(schema)
    except (RecursionError, ValueError):
        raise _bad(param, f"the JSON schema is nested deeper than {MAX_DEPTH} levels") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise _bad(param, f"the JSON schema is {len(text.encode())} bytes, over the limit of {MAX_SCHEMA_BYTES}")
    _walk(schema, param, "schema", 0)
    return text


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_schema")


def _walk(node: Any, param: str, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _bad(param, f"the JSON schema is nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _bad(param, f"{where} must be a schema (an object or a boolean), got {type(node).__name__}")
    _check_counts(node, param, where)
    patterns = [node["pattern"]] if "pattern" in node else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        _regex(pattern, param, f"{where}.pattern")
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        raise _bad(param, f"{where}.required must be a list of property names")
    if "$ref" in node and not isinstance(node["$ref"], str):
        raise _bad(param, f"{where}.$ref must be a string")
    for child_where, child in _children(node, param, where):
        _walk(child, param, child_where, depth + 1)


def _check_counts(node: dict, param: str, where: str) -> None:
    """The counting keywords (``minItems``, ``maxLength``, ...) are integers in ``[0, MAX_COUNT]``."""
    for key in COUNT_KEYWORDS:
        v = node.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT):
            raise _bad(param, f"{where}.{key} must be an integer in [0, {MAX_COUNT}]")


def _children(node: dict, param: str, where: str):
    """``(where, subschema)`` for every subschema of ``node`` (maps, lists and single ones)."""
    for key in SCHEMA_MAPS:
        sub = node.get(key)
        if sub is not None and not isinstance(sub, dict):
            raise _bad(param, f"{where}.{key} must be an object of schemas")
        for name, child in (sub or {}).items():
            yield f"{where}.{key}.{name}", child
    for key in (*SCHEMA_LISTS, "items"):
        sub = node.get(key)
        if key == "items" and not isinstance(sub, list):
            continue
        if sub is not None and not isinstance(sub, list):
            raise _bad(param, f"{where}.{key} must be a list of schemas")
        for i, child in enumerate(sub or ()):
            yield f"{where}.{key}.{i}", child
    for key in SCHEMA_ONES:
        if key in node and not (key == "items" and isinstance(node[key], list)):
            yield f"{where}.{key}", node[key]


def _regex(pattern: Any, param: str, where: str) -> None:
    if not isinstance(pattern, str) or len(pattern) > 1000:
        raise _bad(param, f"{where} must be a regular expression of at most 1000 characters")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise _bad(param, f"{where} is not a valid regular expression: {exc}") from None


class GrammarChecker:
    """Compiles grammars with xgrammar for the router's tokenizer, off the event loop, with a
    timeout and a bounded cache of the ones that compiled. ``compile_ms`` of the last uncached
    compile is kept for logs and ``bench``."""

    def __init__(self, tokenizer, timeout_s: float = COMPILE_TIMEOUT_S, entries: int = CACHE_ENTRIES):
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.entries = entries
        self._ok: OrderedDict[tuple, float] = OrderedDict()  # key -> compile milliseconds
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")
        self._compiler = None
        self._info = None

    def _ensure(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from worker.contract.grammar import tokenizer_info

                stop = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
                self._info = tokenizer_info(self.tokenizer, len(self.tokenizer), stop)
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._compiler

    def build(self) -> None:
        """Build the tokenizer's xgrammar view now, on the calling thread (once: later calls return at once)."""
        self._ensure()

    async def ready(self) -> None:
        """Build the tokenizer's xgrammar view (once; it walks the whole vocabulary) on the pool, off the event loop."""
        if self._compiler is None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._ensure)

    @property
    def info(self):
        """xgrammar's ``TokenizerInfo`` of the router's tokenizer (its ``decoded_vocab`` gives each
        token's bytes, for logprobs)."""
        self._ensure()
        return self._info

    def _compile(self, spec: Grammar) -> float:
        from worker.contract.grammar import compile_grammar

        t0 = time.perf_counter()
        compile_grammar(self._ensure(), spec)
        return (time.perf_counter() - t0) * 1000

    async def check(self, spec: Grammar, param: str) -> float:
        """Compile ``spec`` (or find it cached); returns the compile milliseconds (0 when cached).
        Raises a 400 :class:`ApiError` naming ``param`` when it does not compile in time. The first
        call builds the compiler first (:meth:`ready`: importing xgrammar, and with it torch, and
        walking the vocabulary), outside the timeout: that one-time cost is the router's, not the
        grammar's, and on a loaded box it alone can outlast the timeout."""
        key = (spec.kind, spec.strict, spec.source)
        with self._lock:
            if key in self._ok:
                self._ok.move_to_end(key)
                return 0.0
        await self.ready()
        loop = asyncio.get_running_loop()
        try:
            ms = await asyncio.wait_for(loop.run_in_executor(self._pool, self._compile, spec), self.timeout_s)
        except TimeoutError:
            raise _bad(param, f"the grammar did not compile within {self.timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError, ValueError, ...)
            raise _bad(param, f"the schema cannot be used for constrained decoding: {_first_line(exc)}") from None
        with self._lock:
            self._ok[key] = ms
            while len(self._ok) > self.entries:
                self._ok.popitem(last=False)
        log.info("compiled a %s grammar of %d bytes in %.1f ms", spec.kind, len(spec.source), ms)
        return ms


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:300]  # drop xgrammar's "[time] file.cc:line: "
