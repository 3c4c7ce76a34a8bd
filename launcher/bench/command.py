"""The ``llamadeploy bench`` command line: parses options into :class:`BenchOptions` and runs them.

Imports nothing heavy: httpx and matplotlib (the ``[bench]`` extra), torch and transformers load
only when the command runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer

from launcher.bench.options import SUITES, BenchOptions
from launcher.bench.prompts import SCENARIOS

DEFAULTS = BenchOptions()  # every option's default is BenchOptions' own


def json_file(path: Path | None, flag: str) -> dict | None:
    if path is None:
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{flag} {path}: {exc}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{flag} {path}: expected a JSON object")
    return value


def bench_command(
    base_url: str = typer.Argument(DEFAULTS.base_url, help="OpenAI-compatible base URL (ours or a peer's)"),
    suite: str = typer.Option(
        DEFAULTS.suite,
        help="engine: the engine table (c1, closed loop, burst, doc, stall, doc "
        "again) · load: throughput and latency against --concurrency",
    ),
    model: str | None = typer.Option(None, help="the `model` to request (default: the first of GET /models)"),
    tokenizer: str | None = typer.Option(None, help="tokenizer folder or model name (default: --model, resolved)"),
    output_tokens: int | None = typer.Option(
        None, help="output length of every short prompt (engine: 64) or of every scenario (load)"
    ),
    requests: int | None = typer.Option(None, help="measured requests of a closed loop (default max(8, 4 × clients))"),
    warmup: int | None = typer.Option(None, help="warm-up requests of a closed loop (default: its concurrency)"),
    prompts: int = typer.Option(
        DEFAULTS.prompts, min=1, help="engine: short prompts sent one after another (c1) and at once (burst)"
    ),
    clients: int = typer.Option(DEFAULTS.clients, min=1, help="engine: clients of the closed loop"),
    doc_tokens: int = typer.Option(
        DEFAULTS.doc_tokens, min=32, help="engine: templated length of the document, tokens"
    ),
    doc_output_tokens: int = typer.Option(
        DEFAULTS.doc_output_tokens, min=1, help="engine: the document's answer length"
    ),
    streams: int = typer.Option(DEFAULTS.streams, min=1, help="engine: chat streams running when the document arrives"),
    scenario: list[str] = typer.Option(
        list(DEFAULTS.scenarios), help="load: long (256 in / 128 out) and/or chat (short in / 64 out)"
    ),
    concurrency: str = typer.Option(
        ",".join(map(str, DEFAULTS.concurrency)), help="load: comma-separated concurrency levels"
    ),
    ignore_eos: bool = typer.Option(
        DEFAULTS.ignore_eos, help="send ignore_eos so every request streams exactly the output length"
    ),
    extra_body: str = typer.Option(
        json.dumps(DEFAULTS.extra_body), help="JSON merged into every request body (peer-specific fields)"
    ),
    response_format: Path | None = typer.Option(
        None,
        help="a JSON file with an OpenAI response_format object: engine adds a `json` figure, load sends it always",
    ),
    ceiling: bool = typer.Option(
        DEFAULTS.ceiling, "--ceiling", help="also run one static padded batch in process and print the ratio"
    ),
    compare: list[Path] = typer.Option([], help="an earlier run's JSON (same suite) to compare against"),
    replay: Path | None = typer.Option(
        None, "--from", help="print and plot an earlier run's JSON again (with --compare) instead of running"
    ),
    label: str = typer.Option(DEFAULTS.label, help="name of this run in the table, JSON and plot"),
    output: Path = typer.Option(DEFAULTS.output, help="writes OUTPUT.json and OUTPUT.png"),
    api_key: str | None = typer.Option(None, envvar="LLAMADEPLOY_BENCH_API_KEY", help="bearer key for /v1"),
    timeout: float = typer.Option(DEFAULTS.timeout, help="per-request timeout, seconds"),
    layouts: bool = typer.Option(
        False,
        "--layouts",
        help="GPU hosts: deploy --config as data parallel ×N, tensor parallel N and layer split N in turn "
        "(each its own `up`) and print latency, 8-way throughput and peak memory per GPU side by side",
    ),
    config: Path | None = typer.Option(None, "--config", help="--layouts: the deploy.yaml each layout starts from"),
    gpus: int | None = typer.Option(None, min=1, help="--layouts: N, the GPUs each layout uses (default: all)"),
) -> None:
    """Benchmark an OpenAI-compatible server: the engine table, or throughput against concurrency;
    with --layouts, deploy the model as data parallel, tensor parallel and layer split in turn."""
    if suite not in SUITES:
        raise typer.BadParameter(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    unknown = [s for s in scenario if s not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    try:
        extra = json.loads(extra_body)
    except ValueError as exc:
        raise typer.BadParameter(f"--extra-body: {exc}") from None
    opts = BenchOptions(
        base_url=base_url,
        suite=suite,
        model=model,
        ignore_eos=ignore_eos,
        extra_body=extra,
        response_format=json_file(response_format, "--response-format"),
        api_key=api_key,
        timeout=timeout,
        label=label,
        output=output,
        compare=tuple(compare),
        ceiling=ceiling,
        replay=replay,
        output_tokens=output_tokens,
        requests=requests,
        warmup=warmup,
        prompts=prompts,
        clients=clients,
        doc_tokens=doc_tokens,
        doc_output_tokens=doc_output_tokens,
        streams=streams,
        scenarios=tuple(scenario),
        concurrency=tuple(int(c) for c in concurrency.split(",") if c.strip()),
    )
    missing = [m for m in ("httpx", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        typer.echo(
            f"llamadeploy bench needs the [bench] extra ({', '.join(missing)} missing): "
            "pip install 'llamadeploy[bench]'",
            err=True,
        )
        raise typer.Exit(2)
    if layouts:
        from launcher.bench.layout_runner import run_layouts
        from launcher.console import load_or_exit

        if config is not None:
            load_or_exit(config)  # a bad --config is one line and exit 2, before any layout starts
        run_layouts(config, gpus, opts.short_output_tokens, output)
        return
    from launcher.bench.runner import run_bench

    run_bench(opts, tokenizer)
