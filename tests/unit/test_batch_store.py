"""The Batch API's store and file check: state transitions, restart recovery, exactly-once
output, bounds and per-key visibility (router/batch/store.py, router/batch/files.py)."""

from __future__ import annotations

import json

import pytest

from router.batch.files import parse_batch_file
from router.batch.objects import batch_object, output_line
from router.batch.store import Conflict, Store
from router.errors import ApiError

NOW = 1_700_000_000
DAY = 24 * 3600


def jsonl(*lines: dict) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def chat_line(cid: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": cid}]}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def make_batch(store: Store, owner: str = "alice", n: int = 3):
    lines = [(f"req-{i}", json.dumps({"i": i})) for i in range(n)]
    f = store.add_file(owner, "batch", "in.jsonl", b"x", NOW)
    return store.create_batch(owner, "/v1/chat/completions", f["id"], DAY, {"job": "docs"}, lines, NOW)


def answer_all(store: Store, bid: str, ok: bool = True) -> None:
    for line in store.pending(bid, 100, set()):
        store.finish_line(line, ok, output_line("r", line.custom_id, 200 if ok else 400, {"i": line.idx}))


def test_a_batch_goes_validating_in_progress_finalizing_completed_with_its_counts(tmp_path):
    store = Store(tmp_path)
    row = make_batch(store)
    assert row["status"] == "validating" and batch_object(row)["request_counts"] == {
        "total": 3,
        "completed": 0,
        "failed": 0,
    }
    store.set_status(row["id"], "in_progress", NOW + 1)
    lines = store.pending(row["id"], 10, set())
    assert [x.custom_id for x in lines] == ["req-0", "req-1", "req-2"]
    store.finish_line(lines[0], True, output_line("r0", "req-0", 200, {"a": 1}))
    store.finish_line(lines[1], False, output_line("r1", "req-1", 400, {"error": {}}))
    assert [x.idx for x in store.pending(row["id"], 10, set())] == [2]
    store.finish_line(lines[2], True, output_line("r2", "req-2", 200, {"a": 2}))
    store.set_status(row["id"], "finalizing", NOW + 2)
    store.finalize(row["id"], "completed", NOW + 3)
    done = batch_object(store.batch("alice", row["id"]))
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert (done["in_progress_at"], done["finalizing_at"], done["completed_at"]) == (NOW + 1, NOW + 2, NOW + 3)
    out = [json.loads(x) for x in store.file_content("alice", done["output_file_id"]).decode().splitlines()]
    err = [json.loads(x) for x in store.file_content("alice", done["error_file_id"]).decode().splitlines()]
    assert [x["custom_id"] for x in out] == ["req-0", "req-2"] and [x["custom_id"] for x in err] == ["req-1"]
    assert out[0]["response"]["status_code"] == 200 and err[0]["response"]["status_code"] == 400
    store.set_status(row["id"], "in_progress", NOW + 4)  # a finished batch stays finished
    assert store.batch("alice", row["id"])["status"] == "completed"


def test_a_line_answered_twice_keeps_its_first_answer_once(tmp_path):
    store = Store(tmp_path)
    row = make_batch(store, n=1)
    (line,) = store.pending(row["id"], 10, set())
    assert store.finish_line(line, True, output_line("a", "req-0", 200, {"first": True}))
    assert not store.finish_line(line, True, output_line("b", "req-0", 200, {"first": False}))
    store.finalize(row["id"], "completed", NOW)
    done = store.batch("alice", row["id"])
    text = store.file_content("alice", done["output_file_id"]).decode().splitlines()
    assert len(text) == 1 and json.loads(text[0])["response"]["body"] == {"first": True}
    assert done["completed"] == 1


def test_a_reopened_store_resumes_the_lines_not_done(tmp_path):
    store = Store(tmp_path)
    row = make_batch(store, n=4)
    store.set_status(row["id"], "in_progress", NOW)
    first = store.pending(row["id"], 2, set())
    store.finish_line(first[0], True, output_line("r", first[0].custom_id, 200, {}))
    store.close()  # the router dies with line 1 in flight
    again = Store(tmp_path)
    assert [r["id"] for r in again.active()] == [row["id"]]
    assert [x.idx for x in again.pending(row["id"], 10, set())] == [1, 2, 3]
    assert [x.idx for x in again.pending(row["id"], 10, {1})] == [2, 3]  # a running line is not started twice


def test_cancel_and_expiry_answer_every_line_not_done_with_an_error_line(tmp_path):
    store = Store(tmp_path)
    row = make_batch(store, n=3)
    store.set_status(row["id"], "in_progress", NOW)
    line = store.pending(row["id"], 1, set())[0]
    store.finish_line(line, True, output_line("r", line.custom_id, 200, {}))
    assert store.request_cancel("alice", row["id"], NOW + 1)["status"] == "cancelling"
    assert store.request_cancel("alice", row["id"], NOW + 1)["status"] == "cancelling"
    assert store.close_pending(row["id"], lambda x: json.dumps({"custom_id": x.custom_id, "error": "c"})) == 2
    store.finalize(row["id"], "cancelled", NOW + 2)
    done = store.batch("alice", row["id"])
    assert done["status"] == "cancelled" and (done["completed"], done["failed"]) == (1, 2)
    errors = store.file_content("alice", done["error_file_id"]).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in errors] == ["req-1", "req-2"]
    with pytest.raises(Conflict):
        store.request_cancel("alice", row["id"], NOW + 3)


def test_files_and_batches_are_visible_only_to_their_owner(tmp_path):
    store = Store(tmp_path)
    row = make_batch(store, owner="alice")
    mine = store.add_file("alice", "batch", "a.jsonl", b"{}", NOW)
    assert store.file("bob", mine["id"]) is None and store.file_content("bob", mine["id"]) is None
    assert not store.delete_file("bob", mine["id"]) and store.file("alice", mine["id"]) is not None
    assert store.batch("bob", row["id"]) is None and store.batches("bob", 10) == []
    assert store.request_cancel("bob", row["id"], NOW) is None
    assert store.files("bob", None, 10, None, True) == []
    assert {f["id"] for f in store.files("alice", "batch", 10, None, True)} >= {mine["id"]}
    assert store.delete_file("alice", mine["id"]) and store.file("alice", mine["id"]) is None


def test_list_pages_follow_after(tmp_path):
    store = Store(tmp_path)
    ids = [store.add_file("a", "batch", f"{i}.jsonl", b"x", NOW + i)["id"] for i in range(5)]
    first = store.files("a", None, 2, None, True)
    assert [r["id"] for r in first] == ids[::-1][:3]  # one more than asked: has_more
    second = store.files("a", None, 2, first[1]["id"], True)
    assert [r["id"] for r in second] == ids[::-1][2:5]


def test_retention_deletes_old_files_and_finished_batches_but_keeps_running_ones(tmp_path):
    store = Store(tmp_path)
    running = make_batch(store)
    old = make_batch(store)
    with pytest.raises(Conflict):  # a batch ends only once every line is answered
        store.finalize(old["id"], "completed", NOW)
    answer_all(store, old["id"])
    store.finalize(old["id"], "completed", NOW)
    assert store.cleanup(NOW + 1) == (3, 1)  # both input files and the output file, the finished batch
    assert store.batch("alice", running["id"]) is not None and store.batch("alice", old["id"]) is None


def test_a_good_batch_file_parses_in_order():
    got = parse_batch_file(jsonl(chat_line("a"), chat_line("b")) + b"\n", 10, 4096)
    assert [(r.custom_id, r.url) for r in got] == [("a", "/v1/chat/completions"), ("b", "/v1/chat/completions")]


@pytest.mark.parametrize(
    ("content", "code", "words"),
    [
        (b"{not json\n", "invalid_json_line", "line 1 is not valid JSON"),
        (b"\xff\xfe", "invalid_jsonl", "not UTF-8"),
        (b"\n\n", "empty_file", "no requests"),
        (jsonl(chat_line("a"), chat_line("a")), "duplicate_custom_id", "line 2"),
        (jsonl({**chat_line("a"), "url": "/v1/images"}), "invalid_url", "url must be one of"),
        (jsonl({**chat_line("a"), "method": "GET"}), "invalid_method", "method"),
        (jsonl({**chat_line("a"), "custom_id": ""}), "missing_custom_id", "custom_id"),
        (jsonl({**chat_line("a"), "body": {"stream": True}}), "invalid_body", "stream"),
        (jsonl(*[chat_line(str(i)) for i in range(4)]), "too_many_requests", "more than 3"),
        (jsonl({**chat_line("a"), "body": {"x": "y" * 5000}}), "line_too_large", "over 4096 bytes"),
    ],
)
def test_a_malformed_batch_file_is_a_400_naming_what(content, code, words):
    with pytest.raises(ApiError) as e:
        parse_batch_file(content, 3, 4096)
    assert e.value.status == 400 and e.value.code == code and words in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"
