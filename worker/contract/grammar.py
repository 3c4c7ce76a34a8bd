"""The grammar checks the router and the worker share: compiling a :class:`Grammar` with xgrammar.

The router compiles every grammar a request carries before it is sent (a hostile schema fails there,
with a 400); each worker compiles the same source again into its own cache (:mod:`worker.grammar`).
xgrammar is imported only when a tokenizer's view is built, so this module stays light.
"""

from __future__ import annotations

from worker.contract.protocol import Grammar

KINDS = ("json_object", "json_schema", "regex", "ebnf")


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or grammar support not configured in this process."""


def compile_grammar(compiler, spec: Grammar):
    """Compile ``spec`` with an ``xgrammar.GrammarCompiler``. JSON whitespace is fixed (``", "``
    and ``": "``, no newlines), so a greedy model cannot spin in whitespace until ``max_tokens``.
    Raises whatever xgrammar raises for an invalid grammar."""
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.source)
    raise GrammarError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(KINDS)})")


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of ``tokenizer``; ``vocab_size`` is the model's logits width (it may exceed
    the tokenizer's length), ``stop_token_ids`` the ids that end a sequence."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
