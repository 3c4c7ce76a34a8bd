"""Revisions of a running deployment, and the router's side of apply: the rotated admin token, the
rollout board, the served names of a renamed model (pure logic; files in tmp)."""

from __future__ import annotations

from launcher.config import parse_config
from launcher.supervise.revisions import KEEP, Revisions, config_hash
from router.rollout import ADMIN_TOKEN_GRACE_S, AdminTokens, Board
from router.rollout_protocol import RolloutStatus


def cfg(seqs: int = 8, token: str | None = None):
    return parse_config({"workers": {"max_num_seqs": seqs}, "router": {"admin_token": token}})


def test_each_revision_gets_the_next_number_and_a_hash_without_secrets(tmp_path):
    revs = Revisions(tmp_path, cfg())
    second = revs.record(cfg(seqs=4))
    assert (revs.current.number, second.number) == (2, 2)
    assert second.hash != revs.history[0].hash and len(second.hash) == 12
    assert config_hash(cfg(token="a")) == config_hash(cfg(token="b"))  # a secret changes no shown figure
    assert sorted(p.name for p in (tmp_path / "revisions").iterdir()) == ["r1.json", "r2.json"]


def test_the_run_dir_keeps_the_last_few_and_rollback_finds_the_previous(tmp_path):
    revs = Revisions(tmp_path, cfg())
    for n in range(KEEP + 2):
        revs.record(cfg(seqs=n + 1))
    assert len(list((tmp_path / "revisions").iterdir())) == KEEP
    assert revs.previous().number == revs.current.number - 1
    revs.restore(revs.previous())
    assert revs.current.number == KEEP + 2


def test_a_failed_revision_is_forgotten(tmp_path):
    revs = Revisions(tmp_path, cfg())
    first = revs.current
    failed = revs.record(cfg(seqs=2))
    revs.forget(failed, first)
    assert revs.current is first and revs.previous() is None
    assert not (tmp_path / "revisions" / "r2.json").exists()


def test_a_rotated_admin_token_keeps_the_old_one_for_the_grace_period():
    now = [0.0]
    tokens = AdminTokens("old", clock=lambda: now[0])
    tokens.rotate("new")
    assert tokens.valid() == ["new", "old"]
    now[0] = ADMIN_TOKEN_GRACE_S + 1
    assert tokens.valid() == ["new"]
    tokens.rotate(None)
    assert tokens.valid() == []  # no token configured: the admin API needs none


def test_the_board_is_busy_while_a_rollout_runs():
    board = Board()
    assert not board.busy()
    board.post(RolloutStatus(id="a", state="running"))
    assert board.busy()
    board.post(RolloutStatus(id="a", state="done"))
    assert not board.busy()


def test_a_renamed_model_is_served_under_both_names_while_replicas_of_both_serve():
    import pytest

    from router.errors import ApiError
    from router.rollout import serve_models
    from router.settings import RouterSettings
    from router.state import Api
    from worker.contract.settings import ModelConfig

    old, new = ModelConfig(served_name="old"), ModelConfig(served_name="new")
    api = Api(RouterSettings(model=old), pool=None)
    kept = api.default_model
    serve_models(api, [old, new])  # during the rollout: the old name stays the default
    default = api.for_request(None, "/v1/chat/completions")
    assert list(api.models) == ["old", "new"] and api.default_model is kept and default.pick_model == "old"
    assert api.for_request("new", "/v1/chat/completions").model.name == "new"
    serve_models(api, [new])  # done: the old name went with its last replica
    assert list(api.models) == ["new"] and api.for_request(None, "/v1/chat/completions").pick_model is None
    with pytest.raises(ApiError) as err:
        api.for_request("old", "/v1/chat/completions")
    assert err.value.status == 404


def test_a_changed_section_keeps_its_models_grammar_compiler():
    """A live apply that changes a model's section serves a new ServedModel over the same
    tokenizer: it keeps the compiler built at start, so no structured request after an apply
    pays to build it again."""
    from router.rollout import serve_models
    from router.settings import RouterSettings
    from router.state import Api
    from worker.contract.settings import ModelConfig

    tokenizer = object()
    api = Api(RouterSettings(model=ModelConfig(served_name="m")), pool=None)
    api.default_model.tokenizer = tokenizer
    checker = object()
    api.default_model.grammar_checker = checker  # as router.serve.warm_grammar_checkers leaves it
    serve_models(api, [ModelConfig(served_name="m", max_model_len=1024)])
    served = api.models["m"]
    assert served.config.max_model_len == 1024 and served.grammar_checker is checker
