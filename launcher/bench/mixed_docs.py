"""The mixed suite's documents and questions: real text, two structured questions per document.

The documents are the project descriptions (README long descriptions) of the Python packages
installed beside the bench, from their ``METADATA``: real technical prose in Markdown or
reStructuredText, present on every machine the bench runs on, with no download. Those of at least
``chars`` characters are taken in package-name order, each cut to its first ``chars`` characters
(5,000 characters is about 1,300 prompt tokens with SmolLM2's tokenizer, the issue's READMEs).
"""

from __future__ import annotations

import importlib.metadata
import json

SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["title", "summary"],
    "additionalProperties": False,
}
KEYWORDS_SCHEMA = {
    "type": "object",
    "properties": {"keywords": {"type": "array", "items": {"type": "string"}}},
    "required": ["keywords"],
    "additionalProperties": False,
}
QUESTIONS = (
    ("summary", "Give this document a title and a two-sentence summary.", SUMMARY_SCHEMA),
    ("keywords", "List the document's five most important keywords.", KEYWORDS_SCHEMA),
)


def descriptions(chars: int) -> list[tuple[str, str]]:
    """The installed packages' (name, description) of at least ``chars`` characters, whole, in
    package-name order. Raises RuntimeError when there is none."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name, text = (dist.metadata.get("Name") or "").lower(), dist.metadata.get_payload() or ""
        if name and len(text) >= chars and name not in found:
            found[name] = text
    if not found:
        raise RuntimeError(f"no installed package has a description of {chars} characters or more")
    return sorted(found.items())


def documents(count: int, chars: int) -> list[tuple[str, str]]:
    """``count`` (name, text) documents (module docstring), repeated in order when fewer are installed."""
    ordered = [(name, text[:chars]) for name, text in descriptions(chars)]
    return [ordered[i % len(ordered)] for i in range(count)]


def question_body(model: str | None, text: str, kind: int, max_tokens: int) -> dict:
    """The chat request asking question ``kind`` (an index of :data:`QUESTIONS`) of ``text``: greedy,
    ``max_tokens`` at most, the answer constrained by the question's JSON schema."""
    name, ask, schema = QUESTIONS[kind]
    body = {
        "messages": [{"role": "user", "content": f"{ask}\n\n---\n{text}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    }
    return {**body, "model": model} if model else body


def parses(content: str | None, kind: int) -> bool:
    """The answer is a JSON object with the question's required keys."""
    try:
        value = json.loads(content or "")
    except ValueError:
        return False
    return isinstance(value, dict) and all(k in value for k in QUESTIONS[kind][2]["required"])
