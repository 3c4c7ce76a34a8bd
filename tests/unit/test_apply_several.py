"""``apply`` with a ``models:`` file: the file goes to the supervisor as the user wrote it, and is
refused there with the one line about several models (not as a file that gives both forms)."""

from __future__ import annotations

import pytest

from launcher.config import parse_config
from launcher.rollout.begin import Refused, _target_config
from launcher.rollout.command import request_config
from router.rollout_protocol import ApplyRequest

SEVERAL = {
    "models": [{"name": "smollm2-135m-instruct"}, {"name": "all-minilm-l6-v2", "task": "embed"}],
    "workers": {"devices": "cpu", "replicas": 2},
}


def test_a_models_file_reaches_the_supervisor_as_written():
    cfg = parse_config(SEVERAL)
    again = parse_config(request_config(cfg), "the new deploy.yaml")  # what the supervisor parses
    assert [s.name for s in again.served()] == ["smollm2-135m-instruct", "all-minilm-l6-v2"]
    assert again.workers.replicas == 2


def test_a_models_file_is_refused_with_the_several_models_line():
    request = ApplyRequest(config=request_config(parse_config(SEVERAL)))
    with pytest.raises(Refused) as refused:
        _target_config(None, request)  # the file alone decides: the running deployment is not read
    assert "apply changes a deployment of one model" in str(refused.value)
    assert "not both" not in str(refused.value)


def test_a_one_model_file_is_sent_whole():
    cfg = parse_config({"model": {"name": "smollm2-135m-instruct", "max_model_len": 512}})
    assert parse_config(request_config(cfg)).model.max_model_len == 512
