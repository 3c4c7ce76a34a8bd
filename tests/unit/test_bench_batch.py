"""The batch bench's input file and its exactly-once check (launcher.bench.batch_suite): pure logic."""

from __future__ import annotations

import json

from launcher.bench.batch_suite import BatchRun, batch_input, check_output


def test_batch_input_is_distinct_summary_requests_one_per_custom_id():
    lines = [json.loads(x) for x in batch_input("m", 12, 500, 64).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"doc-{i:03d}" for i in range(12)]
    assert {x["url"] for x in lines} == {"/v1/chat/completions"} and {x["method"] for x in lines} == {"POST"}
    prompts = [x["body"]["messages"][0]["content"] for x in lines]
    assert len(set(prompts)) == 12
    assert all(x["body"]["max_tokens"] == 64 and x["body"]["response_format"]["type"] == "json_schema" for x in lines)


def answer(cid: str, content: str = '{"title": "t", "summary": "s"}') -> dict:
    body = {"choices": [{"message": {"content": content}}]}
    return {"custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}


def test_check_output_counts_missing_and_repeated_custom_ids_across_both_files():
    run = BatchRun(batch={"status": "completed"}, output=[answer("doc-000"), answer("doc-001", "{")])
    run.errors = [{"custom_id": "doc-002", "response": None, "error": {"message": "x"}}]
    good = check_output(run, 3)
    assert good["every_custom_id_once"] and good["lines_back"] == 3 and good["answered_200"] == 2
    assert good["parsed_share"] == 0.5
    run.output.append(answer("doc-001"))
    run.errors = []
    bad = check_output(run, 3)
    assert not bad["every_custom_id_once"] and bad["missing"] == ["doc-002"] and bad["more_than_once"] == ["doc-001"]
