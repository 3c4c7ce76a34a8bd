"""The engine suite's table: which figures it has, which way is better, their targets, and the
ratios of one run to another (pure: no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.bench.summary import ratio


@dataclass(frozen=True)
class Figure:
    """One row of the table. ``unit``: tok/s | s | x (a ratio). ``better``: higher | lower.
    ``target``: (operator, value) the figure itself should meet, or None. ``peer_target``: the
    least ours/peer ratio the engine aims for against a peer at the same precision, or None."""

    key: str
    label: str
    unit: str
    better: str
    target: tuple[str, float] | None = None
    peer_target: float | None = None


FIGURES = [
    Figure("c1_tok_s", "c1 (one after another): output tok/s", "tok/s", "higher", peer_target=1.0),
    Figure("c1_ttft_p50_s", "c1: TTFT p50", "s", "lower"),
    Figure("closed_loop_tok_s", "closed loop of N clients: output tok/s", "tok/s", "higher", peer_target=1.0),
    Figure("closed_loop_ttft_p50_s", "closed loop: TTFT p50", "s", "lower"),
    Figure("burst_ttft_p50_s", "burst (all at once): TTFT p50", "s", "lower"),
    Figure("burst_vs_c1_ttft", "burst / c1 TTFT p50", "x", "lower", target=("<=", 3.0)),
    Figure("doc_ttft_s", "doc alone: TTFT", "s", "lower"),
    Figure("stall_max_gap_s", "stall: longest chunk gap of the streams", "s", "lower"),
    Figure("stall_gap_ratio", "stall: longest / median gap", "x", "lower", target=("<=", 3.0)),
    Figure("doc_again_ttft_s", "doc again: TTFT", "s", "lower"),
    Figure("doc_again_ratio", "doc again / doc TTFT", "x", "lower", target=("<=", 0.2)),
    Figure("json_tok_s", "json (c1 with response_format): tok/s", "tok/s", "higher"),
    Figure("json_vs_plain_tok_s", "json / c1 tok/s", "x", "higher"),
]
BY_KEY = {f.key: f for f in FIGURES}


def engine_figures(details: dict) -> dict[str, float | None]:
    """The table's values from the scenario summaries in ``details`` (keys: c1, closed_loop, burst,
    doc, doc_again, stall and, when measured, json; each as :mod:`launcher.bench.summary` returns)."""
    get = lambda name, key: (details.get(name) or {}).get(key)  # noqa: E731
    figures = {
        "c1_tok_s": get("c1", "output_tokens_per_s"),
        "c1_ttft_p50_s": get("c1", "ttft_p50_s"),
        "closed_loop_tok_s": get("closed_loop", "output_tokens_per_s"),
        "closed_loop_ttft_p50_s": get("closed_loop", "ttft_p50_s"),
        "burst_ttft_p50_s": get("burst", "ttft_p50_s"),
        "doc_ttft_s": get("doc", "ttft_p50_s"),
        "stall_max_gap_s": get("stall", "max_gap_s"),
        "stall_gap_ratio": get("stall", "gap_ratio"),
        "doc_again_ttft_s": get("doc_again", "ttft_p50_s"),
    }
    figures["burst_vs_c1_ttft"] = ratio(figures["burst_ttft_p50_s"], figures["c1_ttft_p50_s"])
    figures["doc_again_ratio"] = ratio(figures["doc_again_ttft_s"], figures["doc_ttft_s"])
    if "json" in details:
        figures["json_tok_s"] = get("json", "output_tokens_per_s")
        figures["json_vs_plain_tok_s"] = ratio(figures["json_tok_s"], figures["c1_tok_s"])
    return figures


def meets(figure: Figure, value: float | None) -> bool | None:
    """Whether ``value`` meets the figure's own target (None: no target or no value)."""
    if figure.target is None or value is None:
        return None
    op, bound = figure.target
    return value <= bound if op == "<=" else value >= bound


@dataclass(frozen=True)
class Comparison:
    """Ours against a peer on one figure. ``ratio`` is ours/peer; ``advantage`` is how many times
    better ours is (>1: ours ahead), i.e. ``ratio`` for higher-is-better figures and its inverse
    for lower-is-better ones."""

    figure: Figure
    ours: float
    peer: float
    ratio: float
    advantage: float

    @property
    def verdict(self) -> str:
        if abs(self.advantage - 1) < 0.005:
            return "even"
        return f"ours ahead {self.advantage:.2f}x" if self.advantage > 1 else f"peer ahead {1 / self.advantage:.2f}x"


def compare(ours: dict, peer: dict) -> list[Comparison]:
    """One :class:`Comparison` per figure both runs measured (with a nonzero value), in table order."""
    rows = []
    for f in FIGURES:
        a, b = ours.get(f.key), peer.get(f.key)
        if a is None or not b or not a:
            continue
        r = a / b
        rows.append(Comparison(f, a, b, r, r if f.better == "higher" else 1 / r))
    return rows
