"""``llamadeploy bench --layouts``: which layouts a host can run, the table and its ratios over
injected results, and the command on a host without GPUs (every row says why it did not run)."""

from __future__ import annotations

import json

from rich.console import Console
from typer.testing import CliRunner

from launcher import cli
from launcher.bench.layout_runner import deploy_config
from launcher.bench.layouts import GiB, LayoutResult, layout_runs, ratio, results_table


def text_of(table) -> str:
    console = Console(width=220, record=True)
    console.print(table)
    return console.export_text()


def test_two_gpus_run_all_three_layouts_over_both():
    dp, tp, split = layout_runs(2)
    assert (dp.name, tp.name, split.name) == ("data parallel ×2", "tensor parallel 2", "layer split 2")
    assert not (dp.skipped or tp.skipped or split.skipped)
    assert dp.workers == {"devices": [0, 1], "replicas": 2, "gpus_per_replica": 1, "tensor_parallel_size": 1}
    assert tp.workers["tensor_parallel_size"] == 2 and tp.workers["replicas"] == 1
    assert split.workers["gpus_per_replica"] == 2 and split.workers["tensor_parallel_size"] == 1
    assert layout_runs(8, 4)[1].workers["devices"] == [0, 1, 2, 3]


def test_one_gpu_runs_data_parallel_only_and_says_why_not_the_others():
    dp, tp, split = layout_runs(1)
    assert not dp.skipped and dp.workers["devices"] == [0]
    assert tp.skipped == split.skipped == "needs 2 or more GPUs; this host has 1"
    assert layout_runs(0)[0].skipped == "no GPU on this host"


def test_the_table_has_the_ratios_against_data_parallel():
    results = [
        LayoutResult("data parallel ×2", latency_s=0.520, throughput=200.0, peak_bytes=int(20 * GiB)),
        LayoutResult("tensor parallel 2", latency_s=0.390, throughput=150.0, peak_bytes=int(12 * GiB)),
        LayoutResult("layer split 2", latency_s=0.650, throughput=90.0, peak_bytes=int(13 * GiB)),
    ]
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text_of(results_table(results)).splitlines()
        if line.count("│") > 3
    }
    assert rows["data parallel ×2"][:5] == ["520", "1.00", "200.0", "1.00", "20.00"]
    assert rows["tensor parallel 2"][:5] == ["390", "1.33", "150.0", "0.75", "12.00"]  # 520/390: ×1.3
    assert rows["layer split 2"][:5] == ["650", "0.80", "90.0", "0.45", "13.00"]


def test_missing_figures_and_rows_not_run_are_dashes_with_their_reason():
    results = [
        LayoutResult("data parallel ×1", latency_s=0.1, throughput=50.0),
        LayoutResult("tensor parallel 2", note="not run: needs 2 or more GPUs; this host has 1"),
    ]
    text = text_of(results_table(results))
    assert "against data parallel ×1" in " ".join(text.split())
    tp_row = next(line for line in text.splitlines() if "tensor parallel 2" in line)
    assert tp_row.count(" - ") >= 4 and "not run: needs 2 or more GPUs" in tp_row
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_each_layout_starts_from_the_given_config_on_its_own_ports():
    base = {"model": {"name": "m"}, "workers": {"max_num_seqs": 16, "devices": "auto"}, "router": {"port": 1}}
    run = layout_runs(2)[1]
    cfg = deploy_config(base, run, 9000, 9001)
    assert cfg["workers"] == {"max_num_seqs": 16, **run.workers}
    assert cfg["router"] == {"port": 9000, "admin_port": 9001} and cfg["model"] == {"name": "m"}
    assert base["workers"]["devices"] == "auto"  # the base is not changed


def test_the_command_on_a_host_without_gpus_runs_nothing_and_exits_cleanly(tmp_path, monkeypatch):
    monkeypatch.setattr("launcher.bench.layout_runner.gpu_count", lambda: 0)
    result = CliRunner().invoke(cli.app, ["bench", "--layouts", "--output", str(tmp_path / "layouts")])
    assert result.exit_code == 0, result.output
    assert "not run: no GPU on this host" in result.output
    assert "not run: needs 2 or more GPUs; this host has 0" in result.output
    saved = json.loads((tmp_path / "layouts.json").read_text())
    assert [r["name"] for r in saved] == ["data parallel ×1", "tensor parallel 2", "layer split 2"]


def test_a_missing_or_invalid_config_is_one_line_and_exit_2_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("launcher.bench.layout_runner.gpu_count", lambda: 0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: {tensor_paralel_size: 2}\n")
    for config, line in [
        (tmp_path / "missing.yaml", "missing.yaml: no such file"),
        (bad, "workers.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)"),
    ]:
        result = CliRunner().invoke(
            cli.app, ["bench", "--layouts", "--config", str(config), "--output", str(tmp_path / "o")]
        )
        assert result.exit_code == 2, result.output
        assert line in " ".join(result.output.split()) and "Traceback" not in result.output
        assert not (tmp_path / "o.json").exists()
