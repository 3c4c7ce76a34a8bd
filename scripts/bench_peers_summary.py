"""The compact table at the end of ``scripts/bench_peers.sh``: per precision pair, ours against
llama-server (and ik_llama.cpp's server where it ran), from the ``bench`` JSON files in OUTDIR.

    python scripts/bench_peers_summary.py OUTDIR

Reads ``ours-PAIR.json``, ``peer-PAIR.json`` and ``ik-PAIR.json``; prints a Markdown table with the
CPU it ran on (vendor model and AVX2 / AVX-512 / VNNI / BF16 / AMX flags), then the kernel table
each of our deployments chose. Ratios are ours / peer: above 1 is ours ahead for tok/s, below 1
for TTFT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.bench.kernels import kernel_lines

PAIRS = {
    "q41": "the Q4_1 file (default) vs the same file",
    "int8": "`quantization: int8` vs Q8_0",
    "bf16": "`dtype: bfloat16` vs bf16",
    "f32": "`dtype: float32` vs f32",
}
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_line() -> str:
    """The CPU: its model name and which of :data:`FLAGS` it has (Linux's /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU: unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    cores = info.count("\nprocessor") + info.startswith("processor")
    return f"CPU: {name}, {cores} logical cores; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS)


def say(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fig(run: dict | None, key: str) -> float | None:
    return (run or {}).get("figures", {}).get(key)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def row(pair: str, ours: dict | None, peer: dict | None, ik: dict | None) -> str:
    """One table row: c1 and closed-loop tok/s with ours/peer, the document's TTFT ratio, our stall
    and repeat ratios, and ik_llama's tok/s ratios to llama-server."""
    c1, pc1 = fig(ours, "c1_tok_s"), fig(peer, "c1_tok_s")
    cl, pcl = fig(ours, "closed_loop_tok_s"), fig(peer, "closed_loop_tok_s")
    cells = [
        PAIRS[pair],
        f"{num(c1, '.1f')} vs {num(pc1, '.1f')}",
        ratio(c1, pc1),
        f"{num(cl, '.1f')} vs {num(pcl, '.1f')}",
        ratio(cl, pcl),
        ratio(fig(ours, "doc_ttft_s"), fig(peer, "doc_ttft_s")),
        num(fig(ours, "stall_gap_ratio"), ".2f"),
        num(fig(ours, "doc_again_ratio"), ".2f"),
    ]
    if ik is None:
        cells += ["-", "-", "-"]
    else:
        ic1, icl = fig(ik, "c1_tok_s"), fig(ik, "closed_loop_tok_s")
        cells += [f"{num(ic1, '.1f')} ({ratio(ic1, pc1)})", f"{num(icl, '.1f')} ({ratio(icl, pcl)})", ratio(c1, ic1)]
    return "| " + " | ".join(cells) + " |"


def main(out: Path) -> None:
    """Print the summary of the runs in ``out``."""
    say(cpu_line())
    say()
    say(
        "| pair | c1 tok/s ours vs llama-server | c1 ratio | closed loop of 8 tok/s | ratio | doc TTFT ours/peer "
        "| stall longest/median | doc again/first | ik c1 tok/s (/llama-server) | ik closed loop (/llama-server) "
        "| ours/ik c1 |"
    )
    say("|---" * 11 + "|")
    tables = []
    for pair in PAIRS:
        runs = [load(out / f"{who}-{pair}.json") for who in ("ours", "peer", "ik")]
        if runs[0] is None and runs[1] is None:
            continue
        say(row(pair, *runs))
        if runs[0] is not None:
            tables.append((pair, kernel_lines(runs[0].get("kernels"))))
    say("\ntargets: c1 and closed loop ≥ 1.0; doc TTFT ours/peer ≤ 1; stall ≤ 3; doc again ≤ 0.2")
    for pair, lines in tables:
        say(f"\nours-{pair}: " + ("\n".join(lines) if lines else "no kernel table (GET /workers gave none)"))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
