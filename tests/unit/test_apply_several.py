"""``apply`` with a ``models:`` file: the file goes to the supervisor as the user wrote it; one that
changes which models are served is refused there in one line (not as a file that gives both forms)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.config import parse_config
from launcher.rollout.begin import Refused, _target_config
from launcher.rollout.command import request_config
from launcher.rollout.plan import changed_keys
from router.rollout_protocol import ApplyRequest

SEVERAL = {
    "models": [
        {"name": "smollm2-135m-instruct", "workers": {"max_num_seqs": 3}},
        {"name": "all-minilm-l6-v2", "task": "embed"},
    ],
    "workers": {"devices": "cpu", "replicas": 2},
}
ONE = {"model": {"name": "smollm2-135m-instruct"}, "workers": {"devices": "cpu"}}


def test_a_models_file_reaches_the_supervisor_as_written():
    cfg = parse_config(SEVERAL)
    again = parse_config(request_config(cfg), "the new deploy.yaml")  # what the supervisor parses
    assert [s.name for s in again.served()] == ["smollm2-135m-instruct", "all-minilm-l6-v2"]
    assert again.workers.replicas == 2
    # an entry's workers keep only what it gives: the top-level keys still reach it
    assert [(s.workers.devices, s.workers.max_num_seqs, s.workers.replicas) for s in again.served()] == [
        ("cpu", 3, 2),
        ("cpu", 8, 2),
    ]
    assert changed_keys(cfg.for_model(0), again.for_model(0)) == []


def test_a_models_file_that_adds_a_model_is_refused_with_one_line():
    running = SimpleNamespace(revisions=SimpleNamespace(current=SimpleNamespace(config=parse_config(ONE))))
    request = ApplyRequest(config=request_config(parse_config(SEVERAL)))
    with pytest.raises(Refused) as refused:
        _target_config(running, request)
    assert str(refused.value) == (
        "models: apply changes the models a deployment serves, not which (smollm2-135m-instruct -> "
        "smollm2-135m-instruct, all-minilm-l6-v2): adding, removing, renaming or reordering a model needs "
        "`llamadeploy up` again"
    )
    assert "not both" not in str(refused.value)


def test_a_one_model_file_is_sent_whole():
    cfg = parse_config({"model": {"name": "smollm2-135m-instruct", "max_model_len": 512}})
    assert parse_config(request_config(cfg)).model.max_model_len == 512
