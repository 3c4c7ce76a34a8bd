"""``model.max_model_len: auto`` (:mod:`launcher.plan.context`, :mod:`launcher.plan.resolve`): the
model's own context length, reduced (one warning line) to what the smallest KV budget holds for
one sequence, never below ``min(native, 2048)``; ``plan`` shows it, ``up`` writes it into the
router's and the workers' settings."""

from __future__ import annotations

import json
import logging

from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.plan.placement import Inventory
from launcher.plan.plan import make_plan
from launcher.plan.resolve import resolve_at_start, resolve_context, resolve_for_apply
from launcher.plan.sizing import kv_bytes_per_token
from tests.helpers.model_configs import SMOLLM2_135M, deploy_file
from worker.contract.shapes import from_hf_config
from worker.contract.units import GiB

CPU = Inventory([], list(range(8)), None, 64 * GiB)
SMOL = from_hf_config({**SMOLLM2_135M, "max_position_embeddings": 8192}, "smollm2")


def config(**workers) -> DeployConfig:
    return DeployConfig.model_validate({"workers": {"devices": "cpu", "replicas": 1, **workers}})


def test_auto_is_the_models_own_length_when_the_kv_budget_holds_it(caplog):
    assert DeployConfig().model.max_model_len == "auto"  # the default
    with caplog.at_level(logging.INFO, "launcher.plan.context"):
        plan = make_plan(config(), CPU, SMOL)
    assert plan.ok and plan.sizing.max_model_len == 8192
    assert "8192 tokens, smollm2's own context length" in caplog.text


def test_auto_is_reduced_to_what_one_sequence_can_hold_with_one_warning(caplog):
    per_token = kv_bytes_per_token(SMOL, "float32")
    gib = 5000 * per_token / GiB  # room for 5000 tokens of float32 KV
    with caplog.at_level(logging.INFO, "launcher.plan.context"):
        plan = make_plan(config(kv_cache_gib=gib), CPU, SMOL, dtype="float32")
    assert plan.ok and plan.sizing.max_model_len == 4992  # 5000 rounded down to a 16-token block
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "trained for 8192 tokens" in warnings[0].getMessage()
    assert "serving 4992" in warnings[0].getMessage() and "workers.kv_cache_gib" in warnings[0].getMessage()
    # a budget under min(native, 2048) is not reduced further: the plan's error says it does not fit
    tiny = make_plan(config(kv_cache_gib=1000 * per_token / GiB), CPU, SMOL, dtype="float32")
    assert tiny.sizing.max_model_len == 2048 and not tiny.ok and "2048-token sequence" in tiny.errors[0]
    # a model naming no context length: 2048
    bare = make_plan(config(), CPU, from_hf_config(SMOLLM2_135M, "bare"))
    assert bare.sizing.max_model_len == 2048


def test_up_writes_a_number_into_the_router_and_worker_settings():
    cfg = resolve_context(config(), CPU, [SMOL])
    assert cfg.model.max_model_len == 8192
    assert cfg.router_settings().model.max_model_len == cfg.worker_settings().model.max_model_len == 8192
    several = DeployConfig.model_validate(
        {"workers": {"devices": "cpu"}, "models": [{"name": "a"}, {"name": "b", "max_model_len": 512}]}
    )
    assert [one.model.max_model_len for one in resolve_context(several, CPU, [SMOL, SMOL]).served()] == [8192, 512]
    given = config()
    given = given.model_copy(update={"model": given.model.model_copy(update={"max_model_len": 1024})})
    assert resolve_at_start(given, CPU) is given  # a number is kept as it is


def test_apply_keeps_the_running_revisions_length_for_the_same_model():
    running = resolve_context(config(), CPU, [SMOL])
    assert resolve_for_apply(config(max_num_seqs=4), running).model.max_model_len == 8192


def test_plan_command_shows_the_figure_up_will_use(tmp_path):
    path = deploy_file(tmp_path, {"devices": "cpu", "replicas": 1})
    folder = tmp_path / "model"
    (folder / "config.json").write_text(json.dumps({**SMOLLM2_135M, "max_position_embeddings": 8192}))
    result = CliRunner().invoke(cli.app, ["plan", path])
    assert result.exit_code == 0, result.output
    assert "max_model_len 8192" in " ".join(result.output.split())
