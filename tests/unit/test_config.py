import pytest

from launcher.config import ConfigError, load_config, parse_config


def test_defaults_are_valid():
    cfg = parse_config({})
    assert cfg.router.port == 8000 and cfg.router.policy == "least_loaded" and cfg.workers.replicas == "auto"


def test_repo_deploy_yaml_is_valid():
    cfg = load_config("deploy.yaml")
    assert cfg.model.name == "smollm2-135m-instruct"


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as e:
        parse_config({"workers": {"max_num_seq": 4}})
    assert "workers.max_num_seq: unknown key (did you mean 'max_num_seqs'?)" in str(e.value)


def test_wrong_type_and_range_are_named():
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"port": 70000, "policy": "random"}})
    msg = str(e.value)
    assert "router.port" in msg and "70000" in msg and "router.policy" in msg


def test_unknown_section():
    with pytest.raises(ConfigError) as e:
        parse_config({"modle": {}})
    assert "modle: unknown key (did you mean 'model'?)" in str(e.value)


def test_overrides_and_env(tmp_path, monkeypatch):
    p = tmp_path / "d.yaml"
    p.write_text("router:\n  port: 9000\n")
    monkeypatch.setenv("LLAMADEPLOY_API_KEYS", "a,b")
    cfg = load_config(p, {"router.policy": "round_robin", "router.host": None})
    assert cfg.router.port == 9000 and cfg.router.policy == "round_robin" and cfg.router.api_keys == ["a", "b"]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_port_and_admin_port_must_differ():
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"port": 18600, "admin_port": 18600}})
    assert "admin_port are both 18600" in str(e.value)
    cfg = parse_config({"router": {"port": 18600, "admin_port": 18601}})
    assert cfg.router.admin_port == 18601


def test_a_value_matching_no_member_of_a_union_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        parse_config({"workers": {"max_prefill_tokens": 0, "devices": [0, "x"]}, "router": {"api_keys": [1]}})
    lines = e.value.problems
    assert [line.split(":")[0].strip() for line in lines] == [
        "router.api_keys[0]",
        "workers.devices",
        "workers.max_prefill_tokens",
    ]
    prefill = next(line for line in lines if "max_prefill_tokens" in line)
    assert "greater than or equal to 1" in prefill and "'auto'" in prefill and "(got 0)" in prefill


@pytest.mark.parametrize(
    "data, line",
    [
        (
            {"cluster": {"backend": "ray"}, "workers": {"tensor_parallel_size": 2}},
            "workers.tensor_parallel_size > 1 is not supported with cluster.backend: ray yet; "
            "set workers.tensor_parallel_size: 1 or cluster.backend: local",
        ),
        (
            {"workers": {"tensor_parallel_size": 2, "gpus_per_replica": 2}},
            "workers: workers.tensor_parallel_size=2 and workers.gpus_per_replica=2 are exclusive "
            "(tensor parallel or a layer split): set one of them to 1",
        ),
        ({"workers": {"replicas": 0}}, "workers.replicas: replicas must be >= 1 or 'auto' (got 0)"),
    ],
)
def test_a_validator_refusal_reads_as_its_own_sentence(data, line):
    """A check across keys is reported as the line it wrote: no empty location in front of a
    whole-file check, no pydantic "Value error, " prefix."""
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems[0] == line


def test_a_bad_item_of_a_union_list_is_named_once_with_its_position():
    with pytest.raises(ConfigError) as e:
        parse_config({"workers": {"devices": [0, "x", "y"]}})
    (line,) = e.value.problems
    assert line.strip() == (
        "workers.devices: Input should be 'auto' or 'cpu', or items 1, 2: input should be a valid integer, "
        "unable to parse string as an integer (got [0, 'x', 'y'])"
    )


def test_a_cli_error_prints_brackets_as_text(capsys):
    import typer

    from launcher import cli

    with pytest.raises(typer.Exit) as e:
        cli.fail("Ray is not installed: pip install 'llamadeploy[ray]'")
    assert e.value.exit_code == 2
    assert "pip install 'llamadeploy[ray]'" in capsys.readouterr().err


def test_model_as_a_plain_string_is_its_name():
    assert parse_config({"model": "smollm2-135m"}).model.name == "smollm2-135m"
    cfg = parse_config({"models": ["a", {"name": "b"}]})
    assert [m.name for m in cfg.models] == ["a", "b"]


@pytest.mark.parametrize(
    "data, key",
    [
        ({"workers": {"replicas": "2"}}, "workers.replicas"),
        ({"workers": {"heartbeat_s": "1.5"}}, "workers.heartbeat_s"),
        ({"router": {"port": "8000"}}, "router.port"),
        ({"models": [{"name": "a", "workers": {"max_num_seqs": "4"}}]}, "models[0].workers.max_num_seqs"),
    ],
)
def test_a_quoted_number_is_refused_like_any_wrong_type(data, key):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    (line,) = e.value.problems
    assert line.strip().startswith(f"{key}: a number is needed, not the string")


def test_the_words_a_number_key_takes_are_still_words():
    assert parse_config({"workers": {"replicas": "auto", "max_prefill_tokens": "auto"}}).workers.replicas == "auto"


def test_up_of_a_directory_says_it_is_one(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
