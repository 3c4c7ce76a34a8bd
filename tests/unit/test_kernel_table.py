"""The kernel table with ggml's kernels among the candidates: picked by measured time (a fake clock),
marked row-count invariant where they run every bucket, and shared by the replicas of a revision
(:func:`worker.quant.autotune.load_or_measure`). The set-up step and the worker without the operator."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.quant import autotune, ggml_kernel, invariance
from worker.quant.autotune import Pick, load_or_measure, tune
from worker.quant.kernels import Candidate, Kernel, candidates
from worker.quant.linear import Linears

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """Moves only when a fake kernel runs: ``cost(rows)`` seconds per call."""

    def __init__(self):
        self.now = 0.0
        self.made = 0

    def time(self) -> float:
        return self.now

    def candidate(
        self,
        name: str,
        cost,
        invariant: bool = False,
        same_as: int | None = None,
        twin: str | None = None,
        held: torch.Tensor | None = None,
    ) -> Candidate:
        """A kernel of ``cost(rows)`` seconds per call; its values differ from every other candidate's
        (each scales the product by its own factor, well within the tolerance) unless ``same_as``
        names the index of the one it reproduces bit for bit. It holds ``held`` (default: a tensor
        of its own: another layout of the weight)."""
        self.made += 1
        scale = 1 + (self.made if same_as is None else same_as) * 2.0**-20
        w, held = torch.ones(4, 8) * scale, torch.zeros(1) if held is None else held

        def fn(x):
            self.now += cost(x.shape[0])
            return F.linear(x, w)

        build = lambda *_: Kernel(name, fn, (held,))  # noqa: E731
        return Candidate(name, 1e-4, lambda *_: True, build, invariant=invariant, twin=twin)


def test_the_table_takes_ggml_where_it_measures_fastest_and_marks_invariance():
    clock = FakeClock()
    pool = [
        clock.candidate("ggml", lambda r: 0.1 * r, invariant=True),  # per-row dot products: linear in rows
        clock.candidate("torch-gemm", lambda r: 0.5 + 0.02 * r),  # a fixed cost, then cheap rows
    ]
    choice, _ = tune(torch.ones(4, 8), torch.float32, CPU, [1, 2, 4, 8, 16], timer=clock.time, pool=pool)
    # ggml: 0.1 0.2 0.4 0.8 1.6; torch-gemm: 0.52 0.54 0.58 0.66 0.82
    assert [p.kernel for p in choice.picks] == ["ggml", "ggml", "ggml", "torch-gemm", "torch-gemm"]
    assert not choice.invariant  # two kernels: a row's values change with the bucket
    only_ggml, _ = tune(torch.ones(4, 8), torch.float32, CPU, [1, 2], timer=clock.time, pool=pool[:1])
    assert only_ggml.invariant
    fast_torch, _ = tune(
        torch.ones(4, 8),
        torch.float32,
        CPU,
        [1, 2],
        timer=clock.time,
        pool=[pool[0], clock.candidate("t", lambda r: 0)],
    )
    assert {p.kernel for p in fast_torch.picks} == {"t"} and not fast_torch.invariant


SERVING_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]  # decode steps of 1-8 sequences, then prefill chunks


def _deterministic_pick(clock: FakeClock, costs: dict) -> list[str]:
    pool = [clock.candidate(name, cost, invariant=True) for name, cost in costs.items()]
    choice, _ = tune(
        torch.ones(4, 8), torch.float32, CPU, SERVING_BUCKETS, timer=clock.time, pool=pool, deterministic=True
    )
    assert choice.invariant
    return [p.kernel for p in choice.picks]


def _vec_dot(rows: int) -> float:
    return 0.05 + 0.02 * rows  # per-row dot products on weights read once: wins a decode step


def _dequant(rows: int) -> float:
    return 0.3 + 0.006 * rows  # the whole weight dequantized per call, then cheap rows: wins a prefill chunk


def _rowwise(rows: int) -> float:
    return 0.04 * rows  # one matrix-vector product per row: a little faster at one row, far slower at 128


def test_the_deterministic_table_weighs_each_bucket_by_ratio():
    # the failure the rule mends: time summed over the buckets, the 128-row bucket decides
    assert sum(map(_vec_dot, SERVING_BUCKETS)) > sum(map(_dequant, SERVING_BUCKETS))
    assert _vec_dot(128) > 2 * _dequant(128) and 4 * _vec_dot(1) < _dequant(1)
    picks = _deterministic_pick(FakeClock(), {"dequant": _dequant, "vec-dot": _vec_dot})
    assert picks == ["vec-dot"] * len(SERVING_BUCKETS)  # one kernel at every bucket: batch invariance
    # time per row summed would take rowwise (its one-row gain outweighs its prefill loss per token);
    # by ratio its 128-row loss outweighs it, and a long document's prefill keeps its speed
    assert sum(_rowwise(r) / r for r in SERVING_BUCKETS) < sum(_dequant(r) / r for r in SERVING_BUCKETS)
    picks = _deterministic_pick(FakeClock(), {"dequant": _dequant, "rowwise": _rowwise})
    assert picks == ["dequant"] * len(SERVING_BUCKETS)


def test_a_near_tie_by_the_product_goes_to_the_kernel_fastest_at_one_row():
    """Two families whose products of times differ by less than invariance.TIE are a tie, decided by
    the one-row bucket (a lone client's decode), whichever of them the product favours by a little;
    beyond TIE the product decides. The times are those measured for a 3072x576 bfloat16 weight
    (tinyBLAS and oneDNN, ms), where the product's ratio moved across 1 from one tuning to the next."""
    tiny = dict(zip(SERVING_BUCKETS, [0.169, 0.151, 0.257, 0.302, 0.577, 0.982, 1.742, 3.120], strict=True))
    onednn = dict(zip(SERVING_BUCKETS, [0.328, 0.244, 0.258, 0.343, 0.473, 0.741, 1.236, 2.213], strict=True))
    product = math.exp(invariance.bucket_cost(tiny, SERVING_BUCKETS) - invariance.bucket_cost(onednn, SERVING_BUCKETS))

    def at(times: dict, r: int) -> float:  # a call of r rows takes its bucket's time (the checks call others)
        return times[min((b for b in SERVING_BUCKETS if b >= r), default=SERVING_BUCKETS[-1])]

    def costs(slower: float) -> dict:  # tinyBLAS's times from 16 rows on times ``slower``
        return {"onednn": lambda r: at(onednn, r), "tinyblas": lambda r: at(tiny, r) * (slower if r >= 16 else 1.0)}

    # tinyBLAS's product 0.90x oneDNN's, then 1.05x (its prefill a little slower): a tie both times
    for slower in (1.0, 1.04):
        assert 0.85 < product * slower**4 < invariance.TIE
        assert _deterministic_pick(FakeClock(), costs(slower)) == ["tinyblas"] * len(SERVING_BUCKETS)
    # 1.3x oneDNN's product: no tie, the product decides
    assert product * 1.1**4 > 1.3
    assert _deterministic_pick(FakeClock(), costs(1.1)) == ["onednn"] * len(SERVING_BUCKETS)


def test_a_deterministic_table_hands_a_bucket_to_a_twin_giving_the_same_values_bit_for_bit():
    """ggml's vec_dot and llamafile's tinyBLAS compute the same Q8_0 sums over the same blocks (declared
    twins): each bucket runs the faster, and a row's values still do not depend on its bucket. A
    kernel giving the same values but not declared a twin, a twin whose values differ here, or a twin
    holding another layout of the weight (its bytes twice) never joins."""
    blocks = torch.zeros(1)

    def pick(twin: str | None, same: bool, shared: bool = True) -> list[str]:
        clock = FakeClock()
        vec_dot = clock.candidate("vec-dot", _vec_dot, invariant=True, held=blocks)
        # faster from 32 rows, row-invariant too; vec-dot's values where ``same``
        gemm = clock.candidate(
            "gemm",
            _dequant,
            invariant=True,
            same_as=clock.made if same else None,
            twin=twin,
            held=blocks if shared else None,
        )
        choice, _ = tune(
            torch.ones(4, 8),
            torch.float32,
            CPU,
            SERVING_BUCKETS,
            timer=clock.time,
            pool=[vec_dot, gemm],
            deterministic=True,
        )
        return [p.kernel for p in choice.picks]

    assert pick("vec-dot", same=True) == ["vec-dot"] * 5 + ["gemm"] * 3
    assert pick(None, same=True) == ["vec-dot"] * len(SERVING_BUCKETS)
    assert pick("vec-dot", same=False) == ["vec-dot"] * len(SERVING_BUCKETS)
    assert pick("vec-dot", same=True, shared=False) == ["vec-dot"] * len(SERVING_BUCKETS)


def test_a_deterministic_table_takes_the_family_whose_buckets_cost_least():
    """A twin holding its own layout (ggml4 beside vec_dot and tinyBLAS) runs alone, and is chosen when
    its times over every bucket cost less than the best mix of the others."""
    blocks = torch.zeros(1)

    def pick(packed_cost) -> list[str]:
        clock = FakeClock()
        pool = [
            clock.candidate("vec-dot", _vec_dot, invariant=True, held=blocks),
            clock.candidate("gemm", _dequant, invariant=True, same_as=1, twin="vec-dot", held=blocks),
            clock.candidate("packed", packed_cost, invariant=True, same_as=1, twin="vec-dot"),
        ]
        choice, _ = tune(
            torch.ones(4, 8), torch.float32, CPU, SERVING_BUCKETS, timer=clock.time, pool=pool, deterministic=True
        )
        assert choice.invariant or {p.kernel for p in choice.picks} == {"vec-dot", "gemm"}
        return [p.kernel for p in choice.picks]

    # faster than vec-dot at every bucket and than the mix overall: alone everywhere
    assert pick(lambda r: 0.8 * _vec_dot(r) if r <= 8 else 0.9 * _dequant(r)) == ["packed"] * len(SERVING_BUCKETS)
    # faster at one row only: the mix of vec-dot and gemm costs less
    assert pick(lambda r: 0.9 * _vec_dot(r) if r == 1 else 2 * _vec_dot(r)) == ["vec-dot"] * 5 + ["gemm"] * 3


def test_bucket_cost_is_the_log_of_the_product_and_a_pruned_bucket_is_never_picked():
    assert math.isclose(invariance.bucket_cost({1: 0.5, 2: 0.5, 4: 1.0}, [1, 2, 4]), math.log(0.25))
    assert invariance.bucket_cost({1: 0.1}, [1, 2]) == math.inf  # not timed at 2 rows: pruned there
    weight = torch.ones(4, 8)
    built = {name: Kernel(name, lambda x: F.linear(x, weight), (weight,)) for name in ("a", "b", "c")}
    built["a"].row_invariant = False  # the fastest, not row-invariant: skipped
    built["b"].row_invariant = built["c"].row_invariant = True
    times = {"a": {1: 0.01, 8: 0.08}, "b": {1: 0.1}, "c": {1: 0.4, 8: 0.4}}
    assert invariance.per_bucket(built, times, [1, 8], 8, torch.float32, CPU) == ["c", "c"]


def test_cpu_timing_runs_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    with autotune.cpu_timing() as clock:
        assert torch.get_num_threads() == 1 and clock is time.thread_time
    assert torch.get_num_threads() == before


def test_replicas_share_one_table(tmp_path):
    """The first replica measures and writes; the next reads the same picks and times nothing."""
    path = tmp_path / autotune.table_name("rev-1")
    clock = FakeClock()
    costs = {"a": lambda r: 1.0, "b": lambda r: 0.5}

    def build(timer):
        with load_or_measure(path) as table:
            linears = Linears(CPU, torch.float32, "none", max_rows=2, timer=timer, shared=table)
            linears.pool = {n: clock.candidate(n, c) for n, c in costs.items()}
            linears(torch.ones(4, 8))
        return linears

    first = build(clock.time)
    assert path.is_file() and [p.kernel for c, _ in first.table() for p in c.picks] == ["b", "b"]
    costs["a"] = lambda r: 0.1  # the machine got busier for b: a second measurement would differ

    def no_clock():
        raise AssertionError("a replica reading the shared table measured")

    second = build(no_clock)
    assert [p.kernel for c, _ in second.table() for p in c.picks] == ["b", "b"]


def test_a_replica_waits_for_the_one_measuring(tmp_path):
    path = tmp_path / "kernels.json"
    order = []

    def slow():
        with load_or_measure(path) as table:
            order.append("first in")
            time.sleep(0.3)
            table["w"] = [Pick(1, "ggml", 0.001)]

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.1)
    with load_or_measure(path) as table:
        order.append("second in")
        assert table == {"w": [Pick(1, "ggml", 0.001)]}
    t.join()
    assert order == ["first in", "second in"]


def test_an_unreadable_table_is_measured_again(tmp_path, caplog):
    path = tmp_path / "kernels.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING), load_or_measure(path) as table:
        assert table == {}
    assert "measuring again" in caplog.text


def test_the_worker_without_the_operator_says_so_in_one_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(ggml_kernel, "_state", {})
    monkeypatch.setenv("LLAMADEPLOY_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="worker.quant.ggml_kernel"):
        assert not ggml_kernel.load()
        assert not ggml_kernel.load()  # once
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ggml kernels not built" in line and "serving with torch's kernels" in line
    assert not [c.name for c in candidates(torch.float32, CPU) if c.name.startswith("ggml")]


def test_set_up_without_a_compiler_still_succeeds(tmp_path):
    """build_ggml_kernels (scripts/setup.sh) with no cmake or compiler on PATH: it says so, exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nice", "dirname"):
        (bin_dir / tool).symlink_to(Path("/usr/bin") / tool)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir), "LLAMADEPLOY_CACHE": str(tmp_path / "cache")}
    script = f"source {ROOT / 'scripts' / 'setup.sh'}; cd {ROOT}; build_ggml_kernels"
    out = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ggml kernels not built (cmake, c++ not found)" in out.stdout and "torch's kernels" in out.stdout


def test_a_deterministic_worker_names_one_table_per_model_and_machine_kept_across_starts(tmp_path, monkeypatch):
    """The replicas of a model read one table in the tuning folder (kept across starts and
    deployments: its entries are keyed by weight shape, rows and candidates, so other settings share
    it); another model another; another machine (its digest) another; with ``workers.deterministic``
    off, none."""
    from worker.contract.settings import WorkerSettings
    from worker.main import kernel_table
    from worker.quant import autotune

    monkeypatch.setenv("LLAMADEPLOY_TUNING_DIR", str(tmp_path / "tuning"))
    on = WorkerSettings.model_validate({"workers": {"deterministic": True}})
    first = kernel_table(on, "/models/a")
    assert first is not None and first.parent == tmp_path / "tuning" and first.name.startswith("kernels-a-")
    assert kernel_table(on, "/models/a") == first
    assert kernel_table(on, "/models/b") != first
    other = WorkerSettings.model_validate({"workers": {"deterministic": True, "max_num_seqs": 4}})
    assert kernel_table(other, "/models/a") == first
    monkeypatch.setattr(autotune, "machine_digest", lambda: "another-cpu")
    assert kernel_table(on, "/models/a") != first
    off = WorkerSettings.model_validate({"workers": {"deterministic": False}})
    assert kernel_table(off, "/models/a") is None


def test_tensor_parallel_ranks_measure_their_own_table(tmp_path):
    """Under tensor parallel no table is shared: a rank holding its lock while its peer waits in a
    collective for it would deadlock two replicas (each rank measures its own)."""
    from worker.contract.settings import WorkerSettings
    from worker.main import kernel_table

    tp = WorkerSettings.model_validate({"workers": {"deterministic": True, "tensor_parallel_size": 2}})
    assert kernel_table(tp, "/models/a") is None


def test_the_weights_on_a_rowwise_fallback_are_counted_for_the_gpu_warning():
    from worker.quant.autotune import Choice, Pick
    from worker.quant.linear import row_by_row

    def choice(*kernels: str) -> Choice:
        return Choice(64, 64, "bfloat16", [Pick(r, k, 1e-4) for r, k in zip((1, 8), kernels, strict=True)], {}, [])

    fast = [(choice("plain-bf16", "plain-bf16"), 64), (choice("int4pack-cuda", "int4pack-cuda"), 32)]
    assert row_by_row(fast) is None
    assert row_by_row(
        [*fast, (choice("rowwise", "rowwise"), 32), (choice("rowwise-dequant", "rowwise-dequant"), 1)]
    ) == (
        33,
        129,
    )
