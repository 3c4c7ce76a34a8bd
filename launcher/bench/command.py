"""The ``llamadeploy bench`` command line: parses options into :class:`BenchOptions` and runs them.

Imports nothing heavy: httpx and matplotlib (the ``[bench]`` extra), torch and transformers load
only when the command runs.
"""

from __future__ import annotations

import dataclasses
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


BASE_URL = typer.Argument(DEFAULTS.base_url, help="OpenAI-compatible base URL (ours or a peer's)")
SUITE = typer.Option(
    DEFAULTS.suite,
    help="engine: the engine table (c1, closed loop, burst, doc, stall, doc "
    "again) · load: throughput and latency against --concurrency · embed: /v1/embeddings inputs/s and "
    "latency at concurrency 1, 8, 64 and one 512-input request · mixed: documents asked structured questions "
    "beside chat clients (chat TTFT alone and beside, longest pause, documents/min, answers that parse) · hold: "
    "a one-replica deployment's only worker replaced by apply, restart-worker and kill -9 under --streams "
    "streaming clients and a request loop (5xx, streams cut, longest hold vs load time; needs --config)",
)
MODEL = typer.Option(
    DEFAULTS.model, help="the `model` to request (default: the first model of GET /models that generates)"
)
TOKENIZER = typer.Option(None, help="tokenizer folder or model name (default: --model, resolved)")
OUTPUT_TOKENS = typer.Option(
    DEFAULTS.output_tokens, help="output length of every short prompt (engine: 64) or of every scenario (load)"
)
REQUESTS = typer.Option(DEFAULTS.requests, help="measured requests of a closed loop (default max(8, 4 × clients))")
WARMUP = typer.Option(DEFAULTS.warmup, help="warm-up requests of a closed loop (default: its concurrency)")
PROMPTS = typer.Option(
    DEFAULTS.prompts, min=1, help="engine: short prompts sent one after another (c1) and at once (burst)"
)
CLIENTS = typer.Option(DEFAULTS.clients, min=1, help="engine: clients of the closed loop")
DOC_TOKENS = typer.Option(DEFAULTS.doc_tokens, min=32, help="engine: templated length of the document, tokens")
DOC_OUTPUT_TOKENS = typer.Option(DEFAULTS.doc_output_tokens, min=1, help="engine: the document's answer length")
STREAMS = typer.Option(
    DEFAULTS.streams, min=1, help="engine: chat streams running when the document arrives; hold: streaming clients"
)
SCENARIO = typer.Option(list(DEFAULTS.scenarios), help="load: long (256 in / 128 out) and/or chat (short in / 64 out)")
CONCURRENCY = typer.Option(",".join(map(str, DEFAULTS.concurrency)), help="load: comma-separated concurrency levels")
IGNORE_EOS = typer.Option(
    DEFAULTS.ignore_eos, help="send ignore_eos so every request streams exactly the output length"
)
EXTRA_BODY = typer.Option(
    json.dumps(DEFAULTS.extra_body), help="JSON merged into every request body (peer-specific fields)"
)
RESPONSE_FORMAT = typer.Option(
    None,
    help="a JSON file with an OpenAI response_format object: engine adds a `json` figure, load sends it always",
)
CEILING = typer.Option(
    DEFAULTS.ceiling, "--ceiling", help="also run one static padded batch in process and print the ratio"
)
COMPARE = typer.Option(
    [], help="an earlier run's JSON (same suite) to compare against; mixed: also a peer's /v1 URL, run after ours"
)
PIPELINES = typer.Option(DEFAULTS.pipelines, min=1, help="mixed: document pipelines")
DOCUMENTS = typer.Option(DEFAULTS.documents, min=1, help="mixed: documents in all")
CHAT_CLIENTS = typer.Option(DEFAULTS.chat_clients, min=1, help="mixed: closed-loop chat clients")
ANSWER_TOKENS = typer.Option(DEFAULTS.answer_tokens, min=1, help="mixed: max_tokens of each structured answer")
REPLAY = typer.Option(
    None, "--from", help="print and plot an earlier run's JSON again (with --compare) instead of running"
)
LABEL = typer.Option(DEFAULTS.label, help="name of this run in the table, JSON and plot")
OUTPUT = typer.Option(DEFAULTS.output, help="writes OUTPUT.json and OUTPUT.png")
API_KEY = typer.Option(DEFAULTS.api_key, envvar="LLAMADEPLOY_BENCH_API_KEY", help="bearer key for /v1")
TIMEOUT = typer.Option(DEFAULTS.timeout, help="per-request timeout, seconds")
LAYOUTS = typer.Option(
    False,
    "--layouts",
    help="GPU hosts: deploy --config as data parallel ×N, tensor parallel N and layer split N in turn "
    "(each its own `up`) and print latency, 8-way throughput and peak memory per GPU side by side",
)
CONFIG = typer.Option(
    None, "--config", help="--layouts: the deploy.yaml each layout starts from; --suite hold: the running deployment's"
)
GPUS = typer.Option(None, min=1, help="--layouts: N, the GPUs each layout uses (default: all)")
PERPLEXITY = typer.Option(
    None,
    "--perplexity",
    help="instead of a suite: the perplexity of this text file through /v1/completions (echo), "
    "llama-perplexity's method",
)
PARALLEL = typer.Option(4, "--parallel", min=1, help="--perplexity: windows in flight at once")
CTX = typer.Option(512, "--ctx", min=4, help="--perplexity: tokens per window (llama-perplexity's -c)")
TOKENIZE_URL = typer.Option(
    None,
    "--tokenize-url",
    help="--perplexity: take the text's token ids from this llama-server's POST /tokenize (same model "
    "file) instead of the model's tokenizer, so the windows are llama-perplexity's exactly",
)
EMBEDDING_LOAD = typer.Option(
    DEFAULTS.embedding_load,
    min=1,
    help="engine: run c1 and the closed loop alone, then beside this many closed-loop one-sentence "
    "/v1/embeddings clients, and print chat with load / chat alone per figure",
)
EMBEDDING_MODEL = typer.Option(
    DEFAULTS.embedding_model,
    help="--embedding-load: the embedding model (default: the first `task: embed` model of GET /models)",
)
CHUNKS = typer.Option(
    None, "--chunks", min=1, help="--perplexity: at most this many windows (llama-perplexity's --chunks)"
)


def bench_command(
    base_url: str = BASE_URL,
    suite: str = SUITE,
    model: str | None = MODEL,
    tokenizer: str | None = TOKENIZER,
    output_tokens: int | None = OUTPUT_TOKENS,
    requests: int | None = REQUESTS,
    warmup: int | None = WARMUP,
    prompts: int = PROMPTS,
    clients: int = CLIENTS,
    doc_tokens: int = DOC_TOKENS,
    doc_output_tokens: int = DOC_OUTPUT_TOKENS,
    streams: int = STREAMS,
    scenario: list[str] = SCENARIO,
    concurrency: str = CONCURRENCY,
    ignore_eos: bool = IGNORE_EOS,
    extra_body: str = EXTRA_BODY,
    response_format: Path | None = RESPONSE_FORMAT,
    ceiling: bool = CEILING,
    compare: list[Path] = COMPARE,
    replay: Path | None = REPLAY,
    label: str = LABEL,
    output: Path = OUTPUT,
    api_key: str | None = API_KEY,
    timeout: float = TIMEOUT,
    layouts: bool = LAYOUTS,
    config: Path | None = CONFIG,
    gpus: int | None = GPUS,
    perplexity: Path | None = PERPLEXITY,
    parallel: int = PARALLEL,
    ctx: int = CTX,
    chunks: int | None = CHUNKS,
    tokenize_url: str | None = TOKENIZE_URL,
    embedding_load: int | None = EMBEDDING_LOAD,
    embedding_model: str | None = EMBEDDING_MODEL,
    pipelines: int = PIPELINES,
    documents: int = DOCUMENTS,
    chat_clients: int = CHAT_CLIENTS,
    answer_tokens: int = ANSWER_TOKENS,
) -> None:
    """Benchmark a server (--suite), deploy layouts in turn (--layouts) or measure perplexity (--perplexity FILE)."""
    opts = bench_options(dict(locals()))  # every option by name, before anything else is bound here
    require_bench_extra()
    if perplexity is not None:
        perplexity_command(opts, tokenizer, perplexity, ctx, chunks, parallel, tokenize_url)
        return
    if layouts:
        from launcher.bench.layout_runner import run_layouts
        from launcher.console import load_or_exit

        if config is not None:
            load_or_exit(config)  # a bad --config is one line and exit 2, before any layout starts
        run_layouts(config, gpus, opts.short_output_tokens, output)
        return
    from launcher.bench.runner import run_bench

    run_bench(opts, tokenizer)


def perplexity_command(
    opts: BenchOptions,
    tokenizer: str | None,
    file: Path,
    ctx: int,
    chunks: int | None,
    parallel: int,
    tokenize_url: str | None,
) -> None:
    """``bench --perplexity FILE``: :func:`launcher.bench.perplexity_run.run_perplexity` with the
    command's options (the server, model, key, timeout, extra body and output from ``opts``)."""
    from launcher.bench.perplexity_run import run_perplexity

    run_perplexity(
        *(opts.base_url, file, ctx, chunks, opts.model, tokenizer, opts.api_key, opts.timeout, parallel),
        *(opts.extra_body, opts.output),
        tokenize_url=tokenize_url,
    )


def bench_options(given: dict) -> BenchOptions:
    """The command's options as :class:`BenchOptions`; ``typer.BadParameter`` (exit 2) on an unknown
    suite or scenario, extra body that is not JSON, or a response format file that is not an object."""
    if given["suite"] not in SUITES:
        raise typer.BadParameter(f"unknown suite {given['suite']!r}; choose from {', '.join(SUITES)}")
    if given["suite"] == "hold" and given.get("config") is None:
        raise typer.BadParameter("--suite hold needs --config: the running deployment's deploy.yaml")
    if given.get("embedding_load") and given["suite"] != "engine":
        raise typer.BadParameter("--embedding-load runs the engine suite's chat figures: use it with --suite engine")
    unknown = [s for s in given["scenario"] if s not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    try:
        extra = json.loads(given["extra_body"])
    except ValueError as exc:
        raise typer.BadParameter(f"--extra-body: {exc}") from None
    same = {f.name for f in dataclasses.fields(BenchOptions)} & given.keys()
    return BenchOptions(
        **{name: given[name] for name in same - {"extra_body", "response_format", "compare", "concurrency"}},
        extra_body=extra,
        response_format=json_file(given["response_format"], "--response-format"),
        compare=tuple(given["compare"]),
        scenarios=tuple(given["scenario"]),
        concurrency=tuple(int(c) for c in given["concurrency"].split(",") if c.strip()),
    )


def require_bench_extra() -> None:
    """Exit 2 naming the ``[bench]`` extra when httpx or matplotlib is not installed."""
    missing = [m for m in ("httpx", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        typer.echo(
            f"llamadeploy bench needs the [bench] extra ({', '.join(missing)} missing): "
            "pip install 'llamadeploy[bench]'",
            err=True,
        )
        raise typer.Exit(2)
