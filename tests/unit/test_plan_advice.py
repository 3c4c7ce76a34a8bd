"""``plan``'s answer when the configured layout does not fit: the layout (or quantization) that
does, its exact deploy.yaml keys and exit 0; exit 1 only when nothing fits. The README's Llama-2
13B and 70B cases (config only, GPUs given as ``--gpus``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.plan.advice import advise
from launcher.plan.placement import Inventory
from launcher.plan.plan import make_plan, parse_gpus
from tests.helpers.model_configs import LLAMA2, llama2

GIB = 2**30


def advice_for(name: str, gpus: str, **model):
    cfg = DeployConfig.model_validate({"model": {"max_model_len": 2048, **model}})
    inv = Inventory(parse_gpus(gpus), [0, 1], None, 64 * GIB)
    shape = llama2(name)
    plan = make_plan(cfg, inv, shape)
    return plan, advise(cfg, inv, shape, plan)


@pytest.mark.parametrize(
    "name, gpus, model, keys, replicas",
    [
        ("13B", "2x24GB", {"dtype": "float16"}, {"workers.tensor_parallel_size": 2}, 1),
        ("70B", "2x48GB", {"quantization": "int8"}, {"workers.tensor_parallel_size": 2}, 1),
        ("70B", "4x24GB", {"quantization": "int8"}, {"workers.tensor_parallel_size": 4}, 1),
        ("13B", "1x24GB", {"dtype": "bfloat16"}, {"model.quantization": "int8"}, 1),
        ("70B", "1x80GB", {"dtype": "bfloat16"}, {"model.quantization": "int4"}, 1),
    ],
)
def test_the_readme_cases_get_the_layout_that_fits(name, gpus, model, keys, replicas):
    plan, advice = advice_for(name, gpus, **model)
    assert not plan.ok  # the default (one replica per GPU, as stored) does not fit
    assert advice is not None and advice.keys == keys
    assert advice.plan.ok and len(advice.plan.specs) == replicas


def test_nothing_fits_no_advice_and_a_fitting_file_needs_none():
    plan, advice = advice_for("70B", "1x24GB")
    assert not plan.ok and advice is None
    plan, advice = advice_for("13B", "1x48GB", dtype="float16")
    assert plan.ok and advice is None


def test_the_keys_print_as_deploy_yaml_sections():
    _, advice = advice_for("70B", "2x48GB", quantization="int8")
    assert advice.yaml() == "workers:\n  tensor_parallel_size: 2"


def test_plan_command_prints_the_recommended_layout_and_exits_0(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2["70B"], "vocab_size": 32000}))
    args = ["plan", "--model", str(tmp_path), "--quantization", "int8"]
    fits = CliRunner().invoke(cli.app, [*args, "--gpus", "2x48GB"])
    assert fits.exit_code == 0, fits.output
    assert "does not fit" in fits.output and "cuda[0,1] (TP 2)" in fits.output
    assert "Set in deploy.yaml:\nworkers:\n  tensor_parallel_size: 2" in fits.output
    nothing = CliRunner().invoke(cli.app, [*args, "--gpus", "1x24GB"])
    assert nothing.exit_code == 1 and "Set in deploy.yaml" not in nothing.output
