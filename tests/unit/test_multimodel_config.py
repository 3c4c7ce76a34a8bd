"""deploy.yaml's ``models:`` list: both forms, per-model workers overrides, and the errors."""

from __future__ import annotations

import pytest

from launcher.config import ConfigError, load_config, parse_config

TWO = [
    {"name": "smollm2-135m-instruct"},
    {"name": "all-minilm-l6-v2", "task": "embed", "workers": {"devices": "cpu", "replicas": 1}},
]


def test_the_one_model_form_is_one_served_model():
    cfg = parse_config({"model": {"name": "m", "served_name": "chat"}, "workers": {"max_num_seqs": 4}})
    (one,) = cfg.served()
    assert one.name == "chat" and one.workers.max_num_seqs == 4 and cfg.models is None
    assert cfg.worker_settings().model.name == "m"
    assert cfg.router_settings().models == []


def test_models_list_each_entry_under_the_top_workers_with_its_own_keys_over_them():
    cfg = parse_config({"models": TWO, "workers": {"devices": "auto", "replicas": 2, "max_num_seqs": 4}})
    chat, embed = cfg.served()
    assert (chat.name, chat.workers.devices, chat.workers.replicas, chat.workers.max_num_seqs) == (
        "smollm2-135m-instruct",
        "auto",
        2,
        4,
    )
    assert (embed.name, embed.model.task, embed.workers.devices, embed.workers.replicas) == (
        "all-minilm-l6-v2",
        "embed",
        "cpu",
        1,
    )
    assert embed.workers.max_num_seqs == 4  # not overridden: the top-level value
    assert cfg.model.name == "smollm2-135m-instruct"  # `model` is the first entry
    assert cfg.worker_settings(1).model.task == "embed" and cfg.worker_settings(1).workers.devices == "cpu"
    assert [m.public_name for m in cfg.router_settings().models] == ["smollm2-135m-instruct", "all-minilm-l6-v2"]
    assert cfg.for_model(1).workers.replicas == 1 and cfg.for_model(1).model.name == "all-minilm-l6-v2"


def test_every_model_key_is_accepted_in_an_entry():
    entry = {
        "name": "m",
        "served_name": "s",
        "dtype": "float32",
        "quantization": "int8",
        "task": "generate",
        "max_model_len": 512,
        "random_init": True,
    }
    (one,) = parse_config({"models": [entry]}).served()
    assert one.model.model_dump() == entry


def test_task_defaults_to_auto_and_is_checked():
    assert parse_config({}).model.task == "auto"
    with pytest.raises(ConfigError, match=r"models\[0\]\.task"):
        parse_config({"models": [{"name": "m", "task": "classify"}]})


def one_error(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    lines = e.value.problems
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_both_forms_at_once_is_one_line():
    assert one_error({"model": {"name": "a"}, "models": [{"name": "b"}]}) == (
        "give either model: (one model) or models: (a list), not both"
    )


def test_duplicate_served_names_name_both_entries():
    line = one_error({"models": [{"name": "a"}, {"name": "b", "served_name": "x"}, {"name": "x"}]})
    assert line == "models[1] and models[2] are both served as 'x': give one of them another served_name"


def test_an_unknown_key_in_an_entry_or_its_workers_is_named():
    assert one_error({"models": [{"name": "a", "workers": {"replica": 2}}]}) == (
        "models[0].workers.replica: unknown key (did you mean 'replicas'?)"
    )
    assert one_error({"models": [{"nme": "a"}]}) == "models[0].nme: unknown key (did you mean 'name'?)"


def test_an_override_that_breaks_a_rule_with_the_top_level_is_an_error():
    line = one_error(
        {"models": [{"name": "a", "workers": {"tensor_parallel_size": 2}}], "workers": {"gpus_per_replica": 2}}
    )
    assert line.startswith("models[0].workers: workers.tensor_parallel_size=2 and workers.gpus_per_replica=2")


def test_every_error_in_an_entry_spells_its_place_as_the_merge_check_does():
    entry_rule = one_error(
        {"models": [{"name": "a"}, {"name": "b", "workers": {"tensor_parallel_size": 2, "gpus_per_replica": 2}}]}
    )
    assert entry_rule.startswith("models[1].workers: workers.tensor_parallel_size=2")
    assert one_error({"models": [{"name": "a"}, {"name": "b", "workers": {"replicas": 0}}]}).startswith(
        "models[1].workers.replicas: "
    )


def test_an_empty_list_is_an_error():
    assert "models" in one_error({"models": []})


def test_several_models_on_ray_are_refused():
    line = one_error({"models": TWO, "cluster": {"backend": "ray"}})
    assert "cluster.backend: ray does not serve yet" in line


def test_workers_for_names_each_models_own_section_and_the_top_level_for_an_unknown_name():
    cfg = parse_config(
        {
            "workers": {"startup_timeout_s": 100},
            "models": [{"name": "a"}, {"name": "b", "workers": {"startup_timeout_s": 900}}],
        }
    )
    assert [cfg.workers_for(n).startup_timeout_s for n in ("a", "b", "", "gone")] == [100, 900, 100, 100]


def test_a_model_override_from_the_command_line_reaches_every_entry(tmp_path):
    from launcher.config import load_config

    path = tmp_path / "deploy.yaml"
    path.write_text("models:\n  - {name: a}\n  - {name: b, dtype: float16}\n")
    cfg = load_config(path, {"model.dtype": "bfloat16", "model.max_model_len": 1024, "router.port": 9100})
    assert [(one.model.dtype, one.model.max_model_len) for one in cfg.served()] == [("bfloat16", 1024)] * 2
    assert cfg.router.port == 9100 and cfg.model.name == "a"


@pytest.mark.parametrize("text", ["models:\n", "models: []\n"])
def test_an_empty_models_list_is_refused_instead_of_serving_the_default_model(tmp_path, text):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="models"):
        load_config(path)


def test_a_dumped_one_model_config_parses_again():
    """``apply`` sends the validated config as JSON (``models: null`` in it)."""
    cfg = parse_config({"model": {"name": "m"}})
    assert parse_config(cfg.model_dump(mode="json")).model.name == "m"
