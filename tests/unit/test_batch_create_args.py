"""``POST /v1/batches``'s body checks (router/batch/api.py:create_args): each bad field a 400 naming it."""

from __future__ import annotations

import pytest

from router.batch.api import create_args, metadata_problem
from router.errors import ApiError

GOOD = {"input_file_id": "file-abc", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        create_args(body)
    return info.value


def test_a_good_body_gives_its_fields():
    assert create_args(dict(GOOD, metadata={"job": "nightly"})) == (
        "file-abc",
        "/v1/chat/completions",
        "24h",
        {"job": "nightly"},
    )
    assert create_args(GOOD)[3] is None


def test_a_missing_input_file_id_is_a_400_as_openai_answers_not_a_404_for_file_none():
    err = refused({k: v for k, v in GOOD.items() if k != "input_file_id"})
    assert (err.status, err.param, err.code) == (400, "input_file_id", "missing_required_parameter")
    assert "None" not in err.message


@pytest.mark.parametrize("fid", [5, "", ["file-abc"], {"id": "file-abc"}])
def test_an_input_file_id_that_is_not_a_string_is_a_400(fid):
    err = refused(dict(GOOD, input_file_id=fid))
    assert (err.status, err.param, err.code) == (400, "input_file_id", "invalid_value")


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"k": 1}, "the value of 'k' must be a string (got int)"),
        ({f"k{i}": "v" for i in range(17)}, "at most 16 pairs (got 17)"),
        ({"k" * 65: "v"}, "is over 64 characters"),
        ({"k": "v" * 513}, "the value of 'k' is over 512 characters"),
        ("nightly", "must be an object of string keys and values (got str)"),
    ],
)
def test_each_metadata_bound_names_what_is_wrong(metadata, says):
    err = refused(dict(GOOD, metadata=metadata))
    assert (err.status, err.param) == (400, "metadata")
    assert says in err.message


def test_metadata_at_openais_bounds_is_accepted():
    assert metadata_problem({f"{i:064d}": "v" * 512 for i in range(16)}) is None


@pytest.mark.parametrize(
    ("field", "value"), [("endpoint", "/v1/moderations"), ("endpoint", None), ("completion_window", "1h")]
)
def test_endpoint_and_window_are_checked(field, value):
    err = refused(dict(GOOD, **{field: value}))
    assert (err.status, err.param, err.code) == (400, field, "invalid_value")


def test_a_body_that_is_not_an_object_is_a_400():
    assert refused([GOOD]).status == 400
