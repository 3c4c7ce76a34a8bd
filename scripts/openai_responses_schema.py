"""Extract the Responses API's response and stream-event schemas from OpenAI's published OpenAPI
document (github.com/openai/openai-openapi, MIT) into tests/openai_schema/responses.json, which the
e2e tests validate every response and event against.

Usage: python scripts/openai_responses_schema.py path/to/openapi.json COMMIT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = ("Response", "ResponseStreamEvent")
DROPPED = frozenset({"description", "example", "examples", "x-oaiMeta", "title", "x-oaiTypeLabel"})
OUT = Path(__file__).resolve().parents[1] / "tests/openai_schema/responses.json"


def refs(node) -> set[str]:
    """The component names ``node`` refers to."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs(v) for k, v in node.items() if k != "$ref"))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def strip(node, names: bool = False):
    """The schema without documentation keys (the validation is the same). ``names``: ``node`` maps
    property names to schemas, where a key like ``description`` is a property, kept."""
    if isinstance(node, dict):
        return {
            k: strip(v, k in ("properties", "patternProperties")) for k, v in node.items() if names or k not in DROPPED
        }
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(source: str, commit: str) -> None:
    schemas = json.loads(Path(source).read_text())["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += refs(schemas[name])
    doc = {
        "$comment": f"From github.com/openai/openai-openapi (MIT) at {commit}: components.schemas reachable "
        f"from {', '.join(ROOTS)}, documentation keys removed. Made by scripts/openai_responses_schema.py.",
        "components": {"schemas": {name: strip(schemas[name]) for name in sorted(keep)}},
    }
    OUT.write_text(json.dumps(doc, indent=None, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
