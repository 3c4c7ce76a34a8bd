"""The kernel table the benchmarked server chose, printed beside its figures.

Our router's ``GET /workers`` carries each worker's kernel table as its Ready reported it
(:class:`~worker.contract.protocol.KernelChoice` rows: a weight shape ``n`` × ``k`` in one format,
how many weights have it, and the kernel each row bucket runs with its measured time per call).
A peer without that endpoint has no table; the bench then records none.
"""

from __future__ import annotations

import httpx

from launcher.bench.client import auth_headers


def server_kernels(base_url: str, api_key: str | None) -> list[dict] | None:
    """The kernel table of the first ready worker of the server at ``base_url`` (a ``/v1`` URL), as
    ``GET /workers`` gives it; None when the server has no such endpoint or no ready worker with a table."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(root + "/workers", timeout=10, headers=auth_headers(api_key))
        workers = r.json().get("workers", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for w in workers:
        if isinstance(w, dict) and w.get("state") == "ready" and w.get("kernels"):
            return w["kernels"]
    return None


def pick_text(pick: dict) -> str:
    """One bucket's pick: ``≤8 ggml 0.031ms`` (no time when the kernel was the only eligible one)."""
    ms = pick.get("ms")
    return f"≤{pick['rows']} {pick['kernel']}" + ("" if ms is None else f" {ms:.3f}ms")


def kernel_lines(kernels: list[dict] | None) -> list[str]:
    """The table as lines, one per weight shape: ``576×1536 Q8_0/g32 ×30: ≤1 ggml 0.031ms, ...``;
    no lines for None or an empty table."""
    if not kernels:
        return []
    lines = ["kernel table of the serving worker (weight n×k format ×count: rows ≤ bucket → kernel, time per call):"]
    for c in kernels:
        picks = ", ".join(pick_text(p) for p in c.get("picks", []))
        lines.append(f"  {c['n']}×{c['k']} {c['weight']} ×{c['count']}: {picks}")
    return lines
