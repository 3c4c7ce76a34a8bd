"""``scripts/bench_peers_summary.py``: the speed comparison's one-table summary from bench JSON files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_peers_summary.py"


def summary_module():
    spec = importlib.util.spec_from_file_location("bench_peers_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(figures: dict, kernels=None) -> dict:
    return {"suite": "engine", "figures": figures, "kernels": kernels}


def test_ratios_per_pair_ik_against_llama_server_and_the_kernel_table(tmp_path, capsys):
    table = [
        {"n": 576, "k": 576, "weight": "Q8_0/g32", "count": 60, "picks": [{"rows": 1, "kernel": "ggml", "ms": 0.03}]}
    ]
    files = {
        "ours-int8": run(
            {
                "c1_tok_s": 90.0,
                "closed_loop_tok_s": 300.0,
                "doc_ttft_s": 2.0,
                "stall_gap_ratio": 1.5,
                "doc_again_ratio": 0.05,
            },
            table,
        ),
        "peer-int8": run({"c1_tok_s": 120.0, "closed_loop_tok_s": 250.0, "doc_ttft_s": 4.0}),
        "ik-int8": run({"c1_tok_s": 150.0, "closed_loop_tok_s": 275.0}),
        "peer-f32": run({"c1_tok_s": 40.0, "closed_loop_tok_s": 160.0}),  # ours failed to start
    }
    for name, body in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    summary_module().main(tmp_path)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "avx512_vnni" in out
    int8 = next(line for line in out.splitlines() if line.startswith("| `quantization: int8`"))
    cells = [c.strip() for c in int8.strip("|").split("|")]
    assert cells[1:] == ["90.0 vs 120.0", "0.75", "300.0 vs 250.0", "1.20", "0.50", "1.50", "0.05",
                         "150.0 (1.25)", "275.0 (1.10)", "0.60"]  # fmt: skip
    f32 = next(line for line in out.splitlines() if line.startswith("| `dtype: float32`"))
    assert "- vs 40.0" in f32 and "| - |" in f32
    assert "bfloat16" not in out.split("targets")[0]  # no run, no row
    assert "ours-int8: kernel table of the serving worker" in out and "576×576 Q8_0/g32 ×60: ≤1 ggml 0.030ms" in out
