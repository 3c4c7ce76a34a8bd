"""One ``llamadeploy bench`` run: resolve the tokenizer, run the suite, add the ceiling and the
comparisons, write ``OUTPUT.json`` and ``OUTPUT.png``, print the table."""

from __future__ import annotations

import asyncio
import json
import time

import typer

from launcher.bench.ceiling import static_ceiling
from launcher.bench.client import served_model
from launcher.bench.engine_suite import build_prompts, prompt_lengths, run_engine_suite
from launcher.bench.kernels import server_kernels
from launcher.bench.load_suite import ratio_lines, run_scenario, scenario_prompts
from launcher.bench.options import BenchOptions
from launcher.bench.plot import plot_engine, plot_load
from launcher.bench.prompts import SCENARIOS, Scenario, prompt_ids
from launcher.bench.report import print_engine, print_load


def load_tokenizer(name: str):
    """The tokenizer of ``name`` (a folder or a model name); returns (its local path, the tokenizer)."""
    from transformers import AutoTokenizer

    from launcher.models import ModelNotFound, resolve_model

    try:
        path = str(resolve_model(name, progress=False))
    except ModelNotFound as exc:
        raise typer.BadParameter(
            f"--tokenizer: {exc} (a peer's /models id is often a file path: pass --tokenizer smollm2-135m-instruct)"
        ) from None
    return path, AutoTokenizer.from_pretrained(path)


def read_others(opts: BenchOptions, suite: str) -> list[dict]:
    """The ``--compare`` runs; each must come from the same suite (files without ``suite`` are load runs)."""
    others = []
    for p in opts.compare:
        other = json.loads(p.read_text())
        if other.get("suite", "load") != suite:
            raise typer.BadParameter(f"--compare {p}: a run of the {other.get('suite', 'load')} suite, not {suite}")
        others.append(other)
    return others


def run_embeddings_bench(opts: BenchOptions, suite: str) -> dict:
    """The embed suite, or an earlier chat-beside-embeddings run replayed (``--from``)."""
    if suite == "embed":
        from launcher.bench.embed_suite import run_embed_bench

        return run_embed_bench(opts, read_others(opts, "embed"))
    from launcher.bench.beside import run_beside_bench

    return run_beside_bench(opts, {}, None)


def run_own_client_bench(opts: BenchOptions, suite: str) -> dict:
    """A suite with its own clients and report (embed, chat beside embeddings, mixed, hold)."""
    if suite in ("embed", "beside"):
        return run_embeddings_bench(opts, suite)
    if suite == "hold":
        from launcher.bench.hold_suite import run_hold_bench

        return run_hold_bench(opts.config, opts.streams, opts.api_key, opts.output, opts.timeout)
    from launcher.bench.mixed_suite import run_mixed_bench

    return run_mixed_bench(opts)


def run_bench(opts: BenchOptions, tokenizer_name: str | None) -> dict:
    """Run ``opts`` against its server; returns the result that was written and printed."""
    suite = json.loads(opts.replay.read_text()).get("suite", "load") if opts.replay is not None else opts.suite
    if suite in ("embed", "beside", "mixed", "hold"):
        return run_own_client_bench(opts, suite)
    if opts.replay is not None:
        result = json.loads(opts.replay.read_text())
        others = read_others(opts, result.get("suite", "load"))
        return report(with_ratios(result, others), others, opts.output.with_suffix(".png"))
    others = read_others(opts, opts.suite)
    model = opts.model or served_model(opts.base_url, opts.api_key)
    model_path, tok = load_tokenizer(tokenizer_name or model or "smollm2-135m-instruct")
    head = {
        "label": opts.label,
        "base_url": opts.base_url,
        "model": model,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "options": opts.public(),
        "kernels": server_kernels(opts.base_url, opts.api_key),
    }
    if opts.suite == "engine" and opts.embedding_load:
        from launcher.bench.beside import run_beside_bench

        return run_beside_bench(opts, head, tok)
    if opts.suite == "engine":
        prompts = build_prompts(tok, opts)
        result = {
            **head,
            "prompt_tokens": prompt_lengths(tok, prompts),
            **asyncio.run(run_engine_suite(opts, model, prompts)),
        }
        if opts.ceiling:
            typer.echo("static-batch ceiling in process ...", err=True)
            result["ceiling"] = static_ceiling(
                model_path, tok, prompts.closed[: opts.clients], opts.short_output_tokens, opts.ignore_eos
            )
    else:
        result = {**head, "suite": "load", "scenarios": []}
        for name in opts.scenarios:
            sc = SCENARIOS[name]
            if opts.output_tokens is not None:
                sc = Scenario(sc.name, sc.input_tokens, opts.output_tokens)
            prompts = scenario_prompts(tok, sc)
            out = asyncio.run(run_scenario(opts, model, sc, prompts, len(prompt_ids(tok, prompts[0]))))
            if opts.ceiling:
                typer.echo(f"{sc.name}: static-batch ceiling in process ...", err=True)
                out["ceiling"] = static_ceiling(
                    model_path, tok, prompts[: max(opts.concurrency)], sc.output_tokens, opts.ignore_eos
                )
            result["scenarios"].append(out)
    with_ratios(result, others)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    json_path = opts.output.with_suffix(".json")
    json_path.write_text(json.dumps(result, indent=2))
    typer.echo(f"wrote {json_path}")
    return report(result, others, opts.output.with_suffix(".png"))


def with_ratios(result: dict, others: list[dict]) -> dict:
    """A load run's ratio lines (scaling, ceiling, each of ``others``), set on each scenario."""
    for sc in result.get("scenarios", []):
        sc["ratios"] = ratio_lines(sc, others, result["label"])
    return result


def report(result: dict, others: list[dict], png_path) -> dict:
    """Plot ``result`` against ``others`` into ``png_path`` and print its table; returns ``result``."""
    engine = result.get("suite", "load") == "engine"
    png_path.parent.mkdir(parents=True, exist_ok=True)
    (plot_engine if engine else plot_load)(result, others, png_path)
    if engine:
        print_engine(result, others)
    else:
        print_load(result)
    typer.echo(f"wrote {png_path}")
    return result
