"""The prompts the bench sends: short chat questions, fixed-length story prompts (load suite) and a
long document of varied text (engine suite), sized with the served model's tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass

PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him. The lamp was older than the town below, and its brass fittings had been polished "
    "by three generations of hands. Ships passed far out at sea, their lights small and steady, and he wrote "
    "each one into the log with the hour, the wind and the state of the water. In winter the storms came from "
    "the north and the tower shook, yet the lamp never failed. One night a small boat appeared near the rocks, "
    "its sail torn and its crew waving lanterns. He rang the bell, lowered the rope ladder, and ran down to the "
    "shore with a coil of line over his shoulder. "
)
QUESTIONS = [
    "What are three tips for staying focused while studying?",
    "Explain how rainbows form.",
    "Write a short poem about autumn leaves.",
    "Why is the sky blue?",
    "Describe a good breakfast.",
    "How do bees make honey?",
    "Give me ideas for a rainy weekend.",
    "What makes a good story?",
]
DOC_QUESTION = "Summarise the report above in one sentence."


@dataclass(frozen=True)
class Scenario:
    """A load-suite scenario. ``input_tokens``: the templated prompt length (None: a short question)."""

    name: str
    input_tokens: int | None
    output_tokens: int


SCENARIOS = {"long": Scenario("long", 256, 128), "chat": Scenario("chat", None, 64)}


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` after the model's chat template, generation prompt included."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def special_token_bias(tokenizer) -> dict[str, int]:
    """A ``logit_bias`` that bans every special token of ``tokenizer`` (``-100``, OpenAI's floor):
    what llama.cpp's server does itself under ``ignore_eos`` (it bans the end-of-generation tokens),
    so a stream forced past its answer goes on in text on every server. Without it an engine that
    keeps ``ignore_eos`` in vLLM's sense samples ``<|im_end|>`` / ``<|im_start|>`` there, tokens
    with no text, and its stream's text pauses for a step or more whatever the engine does."""
    return {str(i): -100 for i in sorted(set(tokenizer.all_special_ids))}


def short_messages(tag: str, index: int) -> list[dict]:
    """A short chat question, distinct per ``(tag, index)`` right after the system prompt, so no
    request reuses another's cached prefix beyond the template's own head."""
    return [{"role": "user", "content": f"[{tag}-{index}] {QUESTIONS[index % len(QUESTIONS)]}"}]


def fit(tokenizer, head: str, body_ids: list[int], tail: str, target: int) -> list[dict]:
    """One user message ``head + body + tail`` whose templated length is ``target`` tokens.

    ``body_ids`` is cut to fit; decoding and re-tokenising can merge or split a token at the cut,
    so the cut is nudged until the length is exact (or as close as 8 tries get).
    """

    def templated(k: int) -> tuple[list[dict], int]:
        msgs = [{"role": "user", "content": head + tokenizer.decode(body_ids[:k]) + tail}]
        return msgs, len(prompt_ids(tokenizer, msgs))

    k = max(1, target - templated(0)[1])
    msgs, n = templated(k)
    for _ in range(8):
        if n == target:
            break
        k = max(1, k + target - n)
        msgs, n = templated(k)
    return msgs


def chat_messages(tokenizer, scenario: Scenario, index: int) -> list[dict]:
    """Load-suite request ``index``: distinct per request, ``input_tokens`` long once templated."""
    if scenario.input_tokens is None:
        return [{"role": "user", "content": f"{QUESTIONS[index % len(QUESTIONS)]} (#{index})"}]
    head = f"Story {index}. Continue this story in at least 500 words.\n\n"
    words = PASSAGE.split()
    body = " ".join(words[index % len(words) :] + words[: index % len(words)]) + " " + PASSAGE * 8
    return fit(tokenizer, head, tokenizer(body, add_special_tokens=False)["input_ids"], "", scenario.input_tokens)


# ---- a long document of varied text ---------------------------------------------------------

_TEAMS = [
    "the finance team",
    "the northern warehouse",
    "the support desk",
    "the audit committee",
    "the mobile app group",
    "the Lisbon office",
    "the data platform crew",
    "the procurement board",
    "a pilot customer in Osaka",
    "the night shift",
    "the legal department",
    "the research lab",
    "the facilities manager",
    "the sales engineers in Toronto",
    "the design studio",
    "the payroll office",
]
_ACTS = [
    "reported",
    "proposed",
    "reviewed",
    "postponed",
    "approved",
    "questioned",
    "measured",
    "finished",
    "rejected",
    "documented",
    "simplified",
    "budgeted for",
    "tested",
    "escalated",
]
_THINGS = [
    "a revised travel policy",
    "the quarterly hiring plan",
    "the migration to the new billing system",
    "a shared calendar for the meeting rooms",
    "the backup schedule for the file servers",
    "new safety training for forklift drivers",
    "the contract with the cleaning company",
    "a redesign of the onboarding checklist",
    "the energy audit of the main building",
    "an upgrade of the customer portal",
    "the inventory count at the coastal depot",
    "a survey of employee commuting habits",
    "the replacement of the office printers",
    "a pilot of four-day rotations in logistics",
    "the archive of signed supplier invoices",
]
_WHYS = [
    "after two rounds of interviews",
    "because the supplier raised prices",
    "once the vendor fixed the export bug",
    "although several managers objected",
    "to meet the regulator's deadline",
    "following complaints from customers",
    "while the budget for next year is still open",
    "because the old process lost paperwork",
    "after a short trial with volunteers",
    "so that the autumn peak is covered",
]
_WHENS = [
    "In March",
    "Last week",
    "On the second Tuesday of the quarter",
    "Before the holidays",
    "Early in May",
    "At the start of the year",
    "During the September review",
    "Over the summer",
    "Yesterday afternoon",
]
_UNITS = ["hours of work", "euros", "pallets", "open tickets", "new accounts", "kilowatt hours", "pages"]


def report_text(seed: int, sentences: int) -> str:
    """Meeting-notes prose of ``sentences`` sentences in sections, drawn with ``random.Random(seed)``:
    every sentence is a fresh combination of names, actions, reasons and numbers, so no span repeats
    (a repeated sentence tokenises into a periodic sequence, which no real document is)."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        if i % 9 == 0:
            out.append(f"\n\nSection {i // 9 + 1}: {rng.choice(_THINGS).capitalize()}.\n")
        n = rng.randint(3, 9800)
        out.append(
            f"{rng.choice(_WHENS)}, {rng.choice(_TEAMS)} {rng.choice(_ACTS)} {rng.choice(_THINGS)} "
            f"{rng.choice(_WHYS)}; the estimate was {n:,} {rng.choice(_UNITS)}. "
        )
    return "".join(out).strip()


def document_messages(tokenizer, target_tokens: int, seed: int, tag: str) -> list[dict]:
    """A report of varied text plus a one-sentence-summary question, ``target_tokens`` long once
    templated. ``tag`` opens the user message, so a document of another run or another ``seed``
    shares no cached prefix with this one beyond the template's head."""
    body = report_text(seed, max(8, target_tokens // 20))
    ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    while len(ids) < target_tokens:  # more sentences than tokens needed, then cut
        body += " " + report_text(seed + 7919 * len(ids), 32)
        ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    return fit(tokenizer, f"Report {tag}.\n", ids, f"\n\n{DOC_QUESTION}", target_tokens)
