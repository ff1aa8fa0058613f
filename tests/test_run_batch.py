"""`mtlqwen run-batch`: an OpenAI batch file through the server's routes in process: one output line per input line
in input order, each answer the one the server gives the same body, refusals as responses with their status,
lines that are no request as errors, and requests beyond the server's capacity retried, not lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from frontend_fixtures import app_for, subprocess_env, wait_ok, write_tiny_chat_checkpoint

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
REQUESTS = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "two", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "max_tokens": 4, "n": 2}},
    {"custom_id": "msg", "method": "POST", "url": "/v1/messages",
     "body": {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "yo"}]}},
    {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "temperature": -1}},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "stream": True}},
    {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
    {"custom_id": "where", "method": "POST", "url": "/v1/embeddings", "body": {}},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("batch"))


def run_batch(ckpt, tmp_path, lines: list[str], *flags) -> tuple[subprocess.CompletedProcess, list[dict]]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    r = subprocess.run([sys.executable, "-m", "mtlqwen", "run-batch", "-i", str(src), "-o", str(dst), "--model",
                        str(ckpt), "--served-model-name", "tiny", "--num-blocks", "64", "--block-tokens", "16", *flags],
                       capture_output=True, text=True, timeout=300, env=subprocess_env())
    return r, [json.loads(x) for x in dst.read_text().splitlines()] if dst.exists() else []


def test_each_line_is_answered_in_order_as_the_server_answers_it(ckpt, tmp_path):
    lines = [json.dumps(x) for x in REQUESTS] + ["not json", "[1, 2]", json.dumps({"custom_id": "", "body": {}})]
    r, out = run_batch(ckpt, tmp_path, lines, "--slots", "2")
    assert r.returncode == 0, r.stderr
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in REQUESTS] + [None, None, None]
    assert len({o["id"] for o in out}) == len(out) and all(o["id"].startswith("batch_req_") for o in out)
    assert "run-batch: 10 requests, 3 answered, 7 failed" in r.stderr
    with TestClient(app_for(ckpt, num_blocks=64)) as c:
        wait_ok(c)
        for req, o in zip(REQUESTS[:4], out):
            want = c.post(req["url"], json=req["body"])
            got = o["response"]
            assert o["error"] is None and got["status_code"] == want.status_code, (req, o)
            body, expected = got["body"], want.json()
            if want.status_code != 200:
                assert body["error"]["param"] == expected["error"]["param"] == "temperature"
                continue
            if req["url"] == "/v1/messages":
                assert body["content"] == expected["content"] and body["usage"] == expected["usage"]
            else:
                assert [ch.get("text") or ch["message"]["content"] for ch in body["choices"]] == \
                    [ch.get("text") or ch["message"]["content"] for ch in expected["choices"]]
                assert body["usage"] == expected["usage"]
    why = [o["error"]["message"] for o in out[4:]]
    assert [o["response"] for o in out[4:]] == [None] * 6
    assert why[:3] == ["a batch request cannot stream", "'method' must be POST, got 'GET'",
                       "'url' must be one of /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, "
                       "got '/v1/embeddings'"]
    assert why[3].startswith("the line is not JSON") and why[4] == "the line is not a JSON object"
    assert why[5] == "'custom_id' must be a non-empty string"


def test_more_requests_than_the_server_holds_are_all_answered(ckpt, tmp_path):
    """One slot and no queue: the requests (one of three choices, refused with 429 until the others finish) wait
    their turn instead of failing."""
    reqs = [{"custom_id": f"r{i}", "url": "/v1/completions",
             "body": {"prompt": f"p{i}", "max_tokens": 3, "n": 3 if i == 2 else 1}} for i in range(6)]
    r, out = run_batch(ckpt, tmp_path, [json.dumps(x) for x in reqs], "--slots", "1", "--max-queue", "2")
    assert r.returncode == 0, r.stderr
    assert [(o["custom_id"], o["response"]["status_code"]) for o in out] == [(f"r{i}", 200) for i in range(6)]
    assert len(out[2]["response"]["body"]["choices"]) == 3


def test_a_missing_input_or_output_place_fails_before_loading(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mtlqwen", "run-batch", "-i", str(tmp_path / "none.jsonl"), "-o",
                        str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert r.returncode == 1 and r.stderr.startswith("mtlqwen run-batch: error: ") and "none.jsonl" in r.stderr
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "in.jsonl").write_text("")
    r = subprocess.run([sys.executable, "-m", "mtlqwen", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                        str(tmp_path / "no" / "out.jsonl")], capture_output=True, text=True, timeout=60,
                       env=subprocess_env())
    assert r.returncode == 1 and "is not a writable directory" in r.stderr, r.stderr


def test_a_checkpoint_that_does_not_load_is_one_error_line(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")
    (tmp_path / "in.jsonl").write_text(json.dumps(REQUESTS[0]) + "\n")
    r = subprocess.run([sys.executable, "-m", "mtlqwen", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                        str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "ck"), "--log-level", "critical"],
                       capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert r.returncode == 1 and r.stderr.splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("mtlqwen run-batch: error: the engine did not start: model_type None is not supported")
    assert not (tmp_path / "out.jsonl").exists()


def test_results_are_written_in_order_as_soon_as_they_can_be(tmp_path):
    from mtlqwen.frontends.run_batch import InOrder  # noqa: PLC0415

    path = tmp_path / "o.jsonl"
    sink = InOrder(str(path), 3)
    sink.put(2, "c", True)
    assert path.read_text() == ""  # line 2 waits for lines 0 and 1
    sink.put(0, "a", True)
    assert path.read_text() == "a\n"
    sink.put(1, "b", False)
    assert path.read_text() == "a\nb\nc\n" and sink.answered == 2 and sink.results == ["", "", ""]
    sink.close(ran=True)
    empty = InOrder(str(tmp_path / "e.jsonl"), 0)
    empty.close(ran=True)
    assert (tmp_path / "e.jsonl").read_text() == ""
    InOrder(str(tmp_path / "never.jsonl"), 1).close(ran=False)
    assert not (tmp_path / "never.jsonl").exists()
