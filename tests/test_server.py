"""`mtlqwen serve` as a real process on 127.0.0.1, driven by the official `openai` client and raw
HTTP (httpx): chat and completions, streaming and not, batching equivalence, disconnects, errors,
the bounded queue, the API key, /health while loading, /metrics. Tiny random model on CPU.

Every network call goes to 127.0.0.1 with a timeout; every wait loop is bounded; the servers are
killed at the end of the module.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from frontend_fixtures import REPO, ServerProcess, free_port, subprocess_env, write_tiny_chat_checkpoint

TIMEOUT = httpx.Timeout(30.0)
KEY = "test-key-123"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat-ckpt"))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    # 4 slots, so 16 clients also exercise the waiting queue; 96 blocks x 16 tokens of KV
    s = ServerProcess(["--model", str(ckpt), "--slots", "4", "--num-blocks", "96", "--block-tokens", "16",
                       "--step-tokens", "64", "--max-queue", "32", "--max-tokens", "24", "--served-model-name", "tiny"],
                      tmp_path_factory.mktemp("logs") / "server.log")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def guarded(ckpt, tmp_path_factory):
    """One slot, one waiting place, an API key, and a 3 s load delay; records /health as soon as it listens."""
    s = ServerProcess(["--model", str(ckpt), "--slots", "1", "--max-queue", "1", "--num-blocks", "96",
                       "--block-tokens", "16", "--api-key", KEY, "--debug-load-delay", "3"],
                      tmp_path_factory.mktemp("logs") / "guarded.log")
    try:
        s.wait_listening()
        r = httpx.get(s.base + "/health", timeout=TIMEOUT)
        chat = httpx.post(s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "hi"}]}, timeout=TIMEOUT)
        s.early = (r.status_code, r.json(), chat.status_code, chat.json())
        yield s
    finally:
        s.stop()


def client(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30.0)


def metric(base: str, name: str, labels: str = "", headers=None) -> float:
    text = httpx.get(base + "/metrics", timeout=TIMEOUT, headers=headers).text
    m = re.search(rf'^mtlqwen:{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def assert_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def sse_events(lines) -> list:
    """Parse `data: <json>` events up to `data: [DONE]` (which must come last)."""
    events, done = [], False
    for line in lines:
        if not line or line.startswith(":"):  # blank separators and keepalive comments
            continue
        assert not done, "data after [DONE]"
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[len("data: "):]))
    assert done, "stream ended without [DONE]"
    return events


# ---- basics

def test_health_models_metrics(server):
    assert httpx.get(server.base + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = client(server.base).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    text = httpx.get(server.base + "/metrics", timeout=TIMEOUT).text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "kv_blocks_used",
                 "kv_blocks_total", "prefix_cache_hit_tokens_total", "spec_decode_num_accepted_tokens_total"):
        assert f"mtlqwen:{name}{{" in text, name
    assert metric(server.base, "kv_blocks_total") == 96


def test_chat_non_streaming_and_streaming_agree(server):
    c = client(server.base)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    ch = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == "tiny"
    assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
    u = full.usage
    assert u.completion_tokens <= 20 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    reasoning = (ch.message.model_extra or {}).get("reasoning_content") or ""

    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choice = [k for k in chunks if k.choices]
    assert [k.choices[0].finish_reason for k in with_choice][-1] == ch.finish_reason
    assert all(k.choices[0].finish_reason is None for k in with_choice[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    content = "".join(k.choices[0].delta.content or "" for k in with_choice)
    streamed_reasoning = "".join((k.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for k in with_choice)
    assert content == (ch.message.content or "")
    assert streamed_reasoning.strip("\n") == reasoning


def test_thinking_switch_per_request(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    on = httpx.post(server.base + "/v1/chat/completions", json=base, timeout=TIMEOUT).json()
    off = httpx.post(server.base + "/v1/chat/completions", timeout=TIMEOUT,
                     json={**base, "chat_template_kwargs": {"enable_thinking": False}}).json()
    # the generation prompt closes an empty think block when thinking is off: "\n</think>\n\n" more
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 4  # "\n", "</think>", "\n", "\n"
    assert "reasoning_content" not in off["choices"][0]["message"]


def test_completions_raw_sse_format(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(server.base + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 12 and plain["usage"]["prompt_tokens"] == len(body["prompt"])
    with httpx.stream("POST", server.base + "/v1/completions", timeout=TIMEOUT,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and all(e.startswith("data: ") for e in raw.strip().split("\n\n"))
    events = sse_events(raw.split("\n"))
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain["choices"][0]["text"]
    # token-id prompts and stop strings
    ids = httpx.post(server.base + "/v1/completions", timeout=TIMEOUT,
                     json={**body, "prompt": list(body["prompt"].encode())}).json()
    assert ids["choices"][0]["text"] == plain["choices"][0]["text"]
    text = plain["choices"][0]["text"]
    if len(text) > 3:
        cut = httpx.post(server.base + "/v1/completions", json={**body, "stop": [text[2:4]]}, timeout=TIMEOUT).json()
        assert cut["choices"][0]["finish_reason"] == "stop" and text.startswith(cut["choices"][0]["text"])
        assert text[2:4] not in cut["choices"][0]["text"]


# ---- batching

def test_sixteen_concurrent_streams_match_alone(server):
    prompts = [f"Client {i} says: {'abc' * (i % 5)} go" for i in range(16)]
    body = {"max_tokens": 24, "temperature": 0}

    def alone(p):
        r = httpx.post(server.base + "/v1/completions", json={**body, "prompt": p}, timeout=TIMEOUT)
        return r.json()["choices"][0]

    steps0 = metric(server.base, "engine_steps_total")
    ref = [alone(p) for p in prompts]
    steps_alone = metric(server.base, "engine_steps_total") - steps0

    async def one(ac: httpx.AsyncClient, p: str):
        async with ac.stream("POST", server.base + "/v1/completions", json={**body, "prompt": p, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=TIMEOUT) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, p) for p in prompts)), 120)

    steps0 = metric(server.base, "engine_steps_total")
    got = asyncio.run(all_at_once())
    steps_together = metric(server.base, "engine_steps_total") - steps0
    assert got == [(r["text"], r["finish_reason"]) for r in ref]
    # 16 requests over 4 slots share steps: far fewer steps than running them one by one
    assert steps_together < 0.5 * steps_alone, (steps_together, steps_alone)


# ---- cancellation

def test_client_disconnect_frees_slot_and_blocks(server):
    aborted0 = metric(server.base, "request_success_total", 'finished_reason="abort"')
    body = {"prompt": "tell me a long story", "max_tokens": 1400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        for _ in range(5):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line ending the event
        assert metric(server.base, "kv_blocks_used") > 0
        assert metric(server.base, "num_requests_running") == 1
    # the connection is closed mid-stream: the request is cancelled and its blocks come back
    deadline = time.monotonic() + 10
    # blocks still in use are those prefix-cache entries hold (a finished request's turn entry)
    while (metric(server.base, "kv_blocks_used") > metric(server.base, "prefix_cache_blocks")
           or metric(server.base, "num_requests_running") > 0):
        assert time.monotonic() < deadline, "blocks not freed after the client disconnected"
        time.sleep(0.05)
    assert metric(server.base, "request_success_total", 'finished_reason="abort"') == aborted0 + 1
    # the same for a client that gives up waiting for a non-streaming answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=0.5))
    deadline = time.monotonic() + 10
    while (metric(server.base, "request_success_total", 'finished_reason="abort"') < aborted0 + 2
           or metric(server.base, "kv_blocks_used") > metric(server.base, "prefix_cache_blocks")):
        assert time.monotonic() < deadline, "a non-streaming request was not cancelled when its client left"
        time.sleep(0.05)
    # and every choice of a request of three
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "n": 3}, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        for _ in range(6):
            assert next(lines).startswith("data: ")
            next(lines)
        assert metric(server.base, "num_requests_running") == 3
    deadline = time.monotonic() + 10
    while (metric(server.base, "request_success_total", 'finished_reason="abort"') < aborted0 + 5
           or metric(server.base, "kv_blocks_used") > metric(server.base, "prefix_cache_blocks")):
        assert time.monotonic() < deadline, "the choices of a request were not all cancelled when its client left"
        time.sleep(0.05)


# ---- errors

@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # a call asked for, no tools given
    ({"tools": [{"type": "function", "function": {"name": "no spaces please"}}]}, "tools[0].function.name"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"best_of": 2, "stream": True}, "best_of"),  # ranked once all are done: no stream
    ({"min_tokens": 10}, "min_tokens"),  # more than max_tokens (4)
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
])
def test_bad_chat_requests_get_400(server, patch, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **patch}
    err = assert_error(httpx.post(server.base + "/v1/chat/completions", json=body, timeout=TIMEOUT), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_bodies_and_unknown_paths_then_still_serving(server):
    r = httpx.post(server.base + "/v1/chat/completions", content=b"{not json", timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]
    assert_error(httpx.post(server.base + "/v1/completions", json=[1, 2], timeout=TIMEOUT), 400)
    assert_error(httpx.post(server.base + "/v1/completions", json={"prompt": ["a", ""]}, timeout=TIMEOUT), 400, "prompt")
    assert_error(httpx.post(server.base + "/v1/completions", json={"prompt": [1, 99999]}, timeout=TIMEOUT), 400)
    assert_error(httpx.get(server.base + "/v1/nothing-here", timeout=TIMEOUT), 404)
    with pytest.raises(openai.BadRequestError):
        client(server.base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=30)
    ok = client(server.base).completions.create(model="tiny", prompt="still alive?", max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    assert metric(server.base, "request_rejected_total", 'status="400"') >= 5


# ---- loading, API key, bounded queue (the guarded server)

def test_health_is_loading_then_ok(guarded):
    status, body, chat_status, chat_body = guarded.early
    assert (status, body) == (503, {"status": "loading"})
    assert chat_status == 503 and chat_body["error"]["code"] == "model_loading"
    guarded.wait_healthy()
    assert httpx.get(guarded.base + "/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_api_key_required_except_health(guarded):
    guarded.wait_healthy()
    b = guarded.base
    assert httpx.get(b + "/health", timeout=TIMEOUT).status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert assert_error(httpx.get(b + path, timeout=TIMEOUT), 401)["code"] == "invalid_api_key"
        assert_error(httpx.get(b + path, timeout=TIMEOUT, headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(b + path, timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert_error(httpx.post(b + "/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT), 401)
    with pytest.raises(openai.AuthenticationError):
        client(b, "wrong").models.list()
    r = client(b, KEY).completions.create(model="default", prompt="hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_queue_full_answers_429_then_recovers(guarded):
    guarded.wait_healthy()
    b, h = guarded.base, {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": "go", "max_tokens": 1400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=TIMEOUT, headers=h) as c1, httpx.Client(timeout=TIMEOUT, headers=h) as c2:
        with c1.stream("POST", b + "/v1/completions", json=long) as running:
            assert running.status_code == 200
            with c2.stream("POST", b + "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # accepted into the one waiting place
                r = httpx.post(b + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=h, timeout=TIMEOUT)
                err = assert_error(r, 429)
                assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
                with pytest.raises(openai.RateLimitError):
                    client(b, KEY).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}])
    deadline = time.monotonic() + 10
    while metric(b, "kv_blocks_used", headers=h) > metric(b, "prefix_cache_blocks", headers=h):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(b + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=h, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


# ---- start-up errors

def test_startup_errors_are_one_line(ckpt):
    def serve(*args):
        cmd = [sys.executable, "-m", "mtlqwen", "serve", "--port", str(free_port()), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=subprocess_env())

    r = serve("--model", "/nonexistent/checkpoint")
    assert r.returncode == 1 and "mtlqwen serve: error: no checkpoint directory" in r.stderr
    assert "Traceback" not in r.stderr
