"""The serve app in process (starlette's TestClient) over a real tiny engine: a request the engine
fails inside a step is a 500 with the engine's reason while /health stays ok, an engine crash answers
every request, chat-template rendering is stopped at its time limit, and the operator reset needs a
keyed server."""

from __future__ import annotations

import json
import re
import time

import pytest
from starlette.testclient import TestClient

from frontend_fixtures import app_for, wait_ok, write_tiny_chat_checkpoint

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("inprocess-ckpt"), eos_reachable=False)


def error_of(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class FailingEngine:
    """A real engine whose step fails the requests seeded 666 the way the engine reports a failure
    inside a step: a finished Delta with finish_reason "error" and the reason, the others unharmed."""

    def __init__(self, engine):
        self.engine, self.doomed = engine, set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, ids, params, request_id=None):
        if params.seed == 666:
            self.doomed.add(request_id)
        return self.engine.submit(ids, params, request_id=request_id)

    def step(self):
        from mtlqwen.runtime.outputs import Delta

        deltas = self.engine.step()
        failed = [Delta(rid, [], finished=True, finish_reason="error", error="injected failure in the sampler")
                  for rid in sorted(self.doomed)]
        for rid in self.doomed:
            self.engine.cancel(rid)
        self.doomed.clear()
        return [d for d in deltas if d.request_id not in {f.request_id for f in failed}] + failed


def test_engine_request_error_is_500_with_reason_and_health_stays_ok(ckpt):
    with TestClient(app_for(ckpt, wrap_engine=FailingEngine)) as c:
        wait_ok(c)
        good = {"prompt": "abc", "max_tokens": 4, "ignore_eos": True}
        alone = c.post("/v1/completions", json=good).json()["choices"][0]["text"]
        r = c.post("/v1/completions", json={**good, "temperature": 0.5, "seed": 666})
        err = error_of(r, 500)
        assert err["message"] == "injected failure in the sampler" and err["type"] == "server_error"
        with c.stream("POST", "/v1/completions", json={**good, "seed": 666, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert json.loads(events[-2][len("data: "):])["error"]["message"] == "injected failure in the sampler"
        assert events[-1] == "data: [DONE]"
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/v1/completions", json=good).json()["choices"][0]["text"] == alone
        text = c.get("/metrics").text
        assert 'mtlqwen:request_success_total{model_name="tiny",finished_reason="error"} 2' in text
        used, held = (int(re.search(rf'mtlqwen:{m}{{model_name="tiny"}} (\d+)', text).group(1))
                      for m in ("kv_blocks_used", "prefix_cache_blocks"))
        assert used == held  # what is left is held by prefix-cache entries only (turn entries of finished requests)


def test_template_rendering_is_time_bounded(ckpt):
    slow = "{% for i in range(2000) %}{% for j in range(2000) %}x{% endfor %}{% endfor %}"
    with TestClient(app_for(ckpt, trust_request_template=True, template_timeout_s=0.5)) as c:
        wait_ok(c)
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template": slow}})
        took = time.monotonic() - t0
        assert error_of(r, 400)["code"] == "template_timeout" and 0.5 <= took < 3, took
        quick = "{% for m in messages %}{{ m.content }}{% endfor %}"
        r = c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template": quick}})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("hi")


class CrashingEngine(FailingEngine):
    """An engine whose step raises outright (a failure the engine could not pin on requests)."""

    def step(self):
        raise RuntimeError("injected crash in the forward")


def test_an_engine_crash_answers_every_request_and_health(ckpt):
    with TestClient(app_for(ckpt, wrap_engine=CrashingEngine)) as c:
        wait_ok(c)
        err = error_of(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}), 500)
        assert err["message"] == "engine failed: RuntimeError: injected crash in the forward"
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert error_of(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}), 503)["type"] == "server_error"


def test_reset_needs_a_keyed_server(ckpt):
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_slow_rendering_does_not_block_the_event_loop(ckpt):
    """While one request's template renders for its full time limit, the event loop answers /health at
    once and another client's completion runs (same loop: httpx's ASGI transport, no threads of ours)."""
    import asyncio

    import httpx

    slow = "{% for i in range(3000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"
    app = app_for(ckpt, trust_request_template=True, template_timeout_s=2.0)
    loop = app.state.server.loop
    loop.start()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://in-process",
                                     timeout=30) as ac:
            deadline = time.monotonic() + 60
            while (await ac.get("/health")).status_code != 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            stuck = asyncio.ensure_future(ac.post("/v1/chat/completions", json={
                **CHAT, "chat_template_kwargs": {"chat_template": slow}}))
            await asyncio.sleep(0.2)
            h0 = time.monotonic()
            health = await ac.get("/health")
            health_s = time.monotonic() - h0
            other = await ac.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            other_done = time.monotonic() - t0
            r = await stuck
            return health, health_s, other, other_done, r, time.monotonic() - t0

    try:
        health, health_s, other, other_done, r, total = asyncio.run(scenario())
    finally:
        loop.stop()
    assert health.status_code == 200 and health_s < 0.5, health_s
    assert other.status_code == 200 and other_done < total, (other_done, total)
    assert error_of(r, 400)["code"] == "template_timeout" and 2.0 <= total < 6, total


def test_penalties_reach_the_engine(ckpt):
    from mtlqwen.runtime import Engine, SamplingParams
    from mtlqwen.tokenizer import load_tokenizer

    prompt = [5, 9, 5, 9, 5, 9, 12]
    body = {"prompt": prompt, "max_tokens": 30, "presence_penalty": 1.5, "frequency_penalty": 0.5,
            "repetition_penalty": 1.3}
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        got = c.post("/v1/completions", json=body)
        assert got.status_code == 200, got.text
        plain = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30}).json()["choices"][0]["text"]
    tok = load_tokenizer(ckpt)
    engine = Engine(str(ckpt), tokenizer=tok, slots=1, num_blocks=32, block_tokens=16)
    want = engine.generate([prompt], SamplingParams(max_tokens=30, presence_penalty=1.5, frequency_penalty=0.5,
                                                    repetition_penalty=1.3))[0]
    assert got.json()["choices"][0]["text"] == want.text != plain  # plain greedy repeats a token by then


def test_logprobs_in_both_shapes_whole_and_streamed(ckpt):
    from mtlqwen.runtime import Engine, SamplingParams
    from mtlqwen.tokenizer import load_tokenizer

    prompt = [5, 9, 5, 9, 5, 9, 12]
    tok = load_tokenizer(ckpt)
    want = Engine(str(ckpt), tokenizer=tok, slots=1, num_blocks=32, block_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=6, logprobs=3))[0]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 3}).json()
        lp = r["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [x.logprob for x in want.logprobs]
        assert lp["tokens"] == [tok.token_bytes(t).decode("utf-8", "replace") for t in want.token_ids]
        text = lambda t: tok.token_bytes(t).decode("utf-8", "replace")  # noqa: E731
        # a text two of the top tokens share (bytes of split characters) is listed once, with the likelier one
        assert lp["top_logprobs"] == [{text(t): v for t, v in reversed(x.top)} for x in want.logprobs]
        assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(6)]
        with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 3,
                                                       "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == lp["token_logprobs"]

        whole = c.post("/v1/chat/completions", json=chat).json()
        content = whole["choices"][0]["logprobs"]["content"]
        assert len(content) == whole["usage"]["completion_tokens"] == 6
        assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
                   and bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] for e in content)
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        streamed = [e for ev in events if ev["choices"] and ev["choices"][0]["logprobs"]
                    for e in ev["choices"][0]["logprobs"]["content"]]
        assert streamed == content
        plain = c.post("/v1/chat/completions", json={**chat, "logprobs": False, "top_logprobs": None}).json()
        assert plain["choices"][0]["logprobs"] is None


def test_a_logit_bias_reaches_the_engine(ckpt):
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "logit_bias": {"65": 100}})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AAAAA", r.text  # byte 65 is "A"
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "logit_bias": {"65": 101}})
        assert error_of(r, 400)["param"] == "logit_bias"
        assert error_of(c.post("/v1/completions", json={"prompt": "abc", "logit_bias": {"A": 1}}), 400)["param"] == \
            "logit_bias"


def test_n_choices_whole_and_streamed(ckpt):
    """Choice i samples with seed + i, so each is the single request with that seed; greedy choices are equal;
    usage counts the prompt once; a stream's chunks carry their choice's index and its usage comes last."""
    hot = {"prompt": "abc", "max_tokens": 5, "temperature": 0.9, "seed": 7}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.9, "seed": 3}
    with TestClient(app_for(ckpt, max_queue=2)) as c:
        wait_ok(c)
        r = c.post("/v1/completions", json={**hot, "n": 3}).json()
        alone = [c.post("/v1/completions", json={**hot, "seed": 7 + i}).json() for i in range(3)]
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        assert [ch["text"] for ch in r["choices"]] == [a["choices"][0]["text"] for a in alone]
        assert r["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
        assert r["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone) == 15
        greedy = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "n": 2}).json()["choices"]
        assert greedy[0]["text"] == greedy[1]["text"]

        whole = c.post("/v1/chat/completions", json={**chat, "n": 2}).json()
        with c.stream("POST", "/v1/chat/completions",
                      json={**chat, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        for i in range(2):
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
            want = whole["choices"][i]
            joined = lambda key: "".join(m["delta"].get(key) or "" for m in mine)  # noqa: E731
            assert joined("reasoning_content").strip("\n") == (want["message"].get("reasoning_content") or "")
            assert joined("content") == want["message"]["content"]
            assert mine[-1]["finish_reason"] == want["finish_reason"]
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]

        assert error_of(c.post("/v1/completions", json={**hot, "n": 17}), 400)["param"] == "n"
        assert error_of(c.post("/v1/completions", json={**hot, "n": 0}), 400)["param"] == "n"
        # 2 slots + a queue of 2: a request of 5 choices cannot be taken
        assert error_of(c.post("/v1/completions", json={**hot, "n": 5}), 429)["code"] == "queue_full"


def test_a_cache_salt_keeps_prefix_hits_within_it(tmp_path):
    ckpt = write_tiny_chat_checkpoint(tmp_path / "ckpt", eos_reachable=False)
    body = {"prompt": "x" * 40, "max_tokens": 2}
    with TestClient(app_for(ckpt, num_blocks=64, prefix_interval=16)) as c:
        wait_ok(c)
        cached = lambda extra: c.post("/v1/completions", json={**body, **extra}).json()["usage"][  # noqa: E731
            "prompt_tokens_details"]["cached_tokens"]
        assert cached({"cache_salt": "alice"}) == 0
        assert cached({"cache_salt": "bob"}) == 0 and cached({}) == 0  # another salt, no salt: no hit
        assert cached({"cache_salt": "alice"}) > 0


def test_tokenize_and_detokenize(ckpt):
    from mtlqwen.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        r = c.post("/tokenize", json={"prompt": "héllo<|im_end|>"}).json()
        assert r["tokens"] == tok.encode("héllo<|im_end|>") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 32 * 16 + 1  # the pool's, under the model's 2,048
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo<|im_end|>"}
        rendered = c.post("/tokenize", json=chat).json()
        used = c.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
        assert rendered["count"] == used  # the chat route's own prompt
        assert error_of(c.post("/detokenize", json={"tokens": [5, 10**6]}), 400)["param"] == "tokens"
        assert error_of(c.post("/tokenize", json={"prompt": 5}), 400)["param"] == "prompt"
        assert error_of(c.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404)["param"] == "model"


def test_structured_replies_through_every_field(ckpt):
    """response_format (json_object, json_schema), vLLM's guided_* and Anthropic's output_config: each reply is
    what it asked for; with thinking on, the form starts after the thinking (a bias ends it at once here)."""
    from mtlqwen.tokenizer import load_tokenizer

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    msgs = [{"role": "user", "content": "hi"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    end = load_tokenizer(ckpt).token_to_id("</think>")
    with TestClient(app_for(ckpt, num_blocks=64)) as c:
        wait_ok(c)
        chat = lambda **kw: c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 40, **kw})  # noqa: E731
        r = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **off).json()
        assert json.loads(r["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
        obj = chat(response_format={"type": "json_object"}, max_completion_tokens=200, **off).json()["choices"][0]
        text = obj["message"]["content"]
        assert text.startswith("{")  # the object is opened however the reply ends
        if obj["finish_reason"] == "stop":  # a random model may write a long object: then it is cut at the budget
            assert isinstance(json.loads(text), dict)
        else:
            assert obj["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_regex": "[0-9]{3}-[a-z]"}).json()
        assert re.fullmatch("[0-9]{3}-[a-z]", r["choices"][0]["text"])
        r = chat(guided_choice=["left", "right"], logit_bias={str(end): 100}).json()["choices"][0]
        assert r["message"]["content"] in ("left", "right") and r["finish_reason"] == "stop"  # thought, then chose
        m = c.post("/v1/messages", json={"messages": msgs, "max_tokens": 40, "thinking": {"type": "disabled"},
                                         "output_config": {"format": {"type": "json_schema", "schema": schema}}}).json()
        assert json.loads(m["content"][0]["text"]) in ({"ok": True}, {"ok": False})
        bad = [({"guided_regex": "(", "prompt": "x"}, "guided_regex"),
               ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "prompt": "x"},
                "response_format"),
               ({"guided_regex": "a", "guided_choice": ["b"], "prompt": "x"}, "guided_choice")]
        for body, param in bad:
            assert error_of(c.post("/v1/completions", json=body), 400)["param"] == param


def test_echo_with_the_prompts_logprobs_as_lm_eval_asks(ckpt):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs 1, one token. The prompt's logprobs are
    the engine's, the first null; the text is prompt + completion; streamed alike."""
    from mtlqwen.runtime import Engine, SamplingParams
    from mtlqwen.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    prompt = tok.encode("The capital of France is Paris")
    want = Engine(str(ckpt), tokenizer=tok, slots=1, num_blocks=32, block_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        ch = c.post("/v1/completions", json=body).json()["choices"][0]
        assert ch["text"] == tok.decode(prompt) + want.text
        lp = ch["logprobs"]
        assert lp["token_logprobs"] == [None] + [x.logprob for x in want.prompt_logprobs[1:]] + [want.logprobs[0].logprob]
        assert lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(prompt) + 1
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == ch["text"]
        assert [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]] \
            == lp["token_logprobs"]
        plain = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True}).json()["choices"][0]
        assert plain["text"].startswith("abc") and plain["logprobs"] is None


def test_a_server_wide_chat_template_replaces_the_checkpoints(ckpt, tmp_path):
    from mtlqwen.frontends.args import read_template_file

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    with TestClient(app_for(ckpt, template_defaults={"chat_template": read_template_file(str(path))})) as c:
        wait_ok(c)
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert r["count"] == len("[user:hi]")
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="--chat-template: .* is empty"):
        read_template_file(str(tmp_path / "empty.jinja"))


def test_best_of_answers_the_likeliest_candidates(ckpt):
    """best_of 3, n 1: the three candidates are the single requests seeded 9, 10, 11; the answer is the one whose
    tokens have the highest summed logprob; usage counts every candidate's tokens."""
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 1.0, "seed": 9}
    with TestClient(app_for(ckpt, max_queue=4)) as c:
        wait_ok(c)
        alone = [c.post("/v1/completions", json={**body, "seed": 9 + i, "logprobs": 0}).json()["choices"][0]
                 for i in range(3)]
        best = max(alone, key=lambda ch: sum(ch["logprobs"]["token_logprobs"]))
        r = c.post("/v1/completions", json={**body, "best_of": 3}).json()
        assert [ch["text"] for ch in r["choices"]] == [best["text"]] and r["choices"][0]["logprobs"] is None
        assert r["usage"]["completion_tokens"] == 18
        two = c.post("/v1/completions", json={**body, "best_of": 3, "n": 2}).json()["choices"]
        ranked = sorted(alone, key=lambda ch: -sum(ch["logprobs"]["token_logprobs"]))
        assert [(ch["index"], ch["text"]) for ch in two] == [(0, ranked[0]["text"]), (1, ranked[1]["text"])]
        assert error_of(c.post("/v1/completions", json={**body, "best_of": 1, "n": 2}), 400)["param"] == "best_of"
        assert error_of(c.post("/v1/completions", json={**body, "best_of": 2, "stream": True}), 400)["param"] == \
            "best_of"


def test_a_pattern_among_the_served_names_matches_request_names(ckpt):
    from mtlqwen.frontends.server_state import ServerConfig  # noqa: PLC0415

    with TestClient(app_for(ckpt, served_names=("tiny", "claude-*", "gpt-?"))) as c:
        wait_ok(c)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]  # patterns are not listed
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for name in ("tiny", "claude-haiku-4-5", "gpt-4"):
            r = c.post("/v1/chat/completions", json={**chat, "model": name})
            assert r.status_code == 200 and r.json()["model"] == "tiny", (name, r.text)
        for name in ("claude", "gpt-40", "Claude-x"):  # whole-name, case-sensitive matches only
            assert error_of(c.post("/v1/chat/completions", json={**chat, "model": name}), 404)["param"] == "model"
        msg = {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = c.post("/v1/messages", json=msg)
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    with pytest.raises(ValueError, match="cannot be a pattern: 'claude-\\*'"):
        ServerConfig(served_names=("claude-*", "tiny"), slots=1)
    from types import SimpleNamespace  # noqa: PLC0415

    from mtlqwen.frontends.server import served_names  # noqa: PLC0415

    with pytest.raises(ValueError, match="--served-model-name: the first name .* cannot be a pattern"):
        served_names(SimpleNamespace(served_model_name=["claude-*"], model=None))


def test_a_batch_of_prompts_answers_each_as_alone(ckpt):
    """A completion's list of prompts: prompt k's choice i is at index k * n + i and is that prompt's request alone
    (seed + i); echo and logprobs follow each prompt (lm-eval's batched loglikelihood); usage counts each prompt
    once; a stream's chunks carry those indices, its usage last; best_of ranks within each prompt."""
    prompts = ["abc", "hello there", "xyz"]  # a batch is of strings or of token lists (OpenAI's), not both
    hot = {"max_tokens": 4, "temperature": 0.9, "seed": 7}
    with TestClient(app_for(ckpt, max_queue=8)) as c:
        wait_ok(c)
        r = c.post("/v1/completions", json={**hot, "prompt": prompts, "n": 2}).json()
        alone = [[c.post("/v1/completions", json={**hot, "prompt": p, "seed": 7 + i}).json() for i in range(2)]
                 for p in prompts]
        assert [ch["index"] for ch in r["choices"]] == list(range(6))
        assert [ch["text"] for ch in r["choices"]] == [a[i]["choices"][0]["text"] for a in alone for i in range(2)]
        assert r["usage"]["prompt_tokens"] == sum(a[0]["usage"]["prompt_tokens"] for a in alone)
        assert r["usage"]["completion_tokens"] == sum(a[i]["usage"]["completion_tokens"] for a in alone for i in range(2))

        lm = {"prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
        both = c.post("/v1/completions", json=lm).json()["choices"]
        each = [c.post("/v1/completions", json={**lm, "prompt": p}).json()["choices"][0] for p in lm["prompt"]]
        assert [ch["index"] for ch in both] == [0, 1]
        assert [(ch["text"], ch["logprobs"]) for ch in both] == [(ch["text"], ch["logprobs"]) for ch in each]

        body = {**hot, "prompt": prompts[:2], "n": 2, "echo": True, "stream": True,
                "stream_options": {"include_usage": True}}
        whole = c.post("/v1/completions", json={**body, "stream": False}).json()
        with c.stream("POST", "/v1/completions", json=body) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        for i, want in enumerate(whole["choices"]):
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
            assert "".join(m["text"] for m in mine) == want["text"] and want["text"].startswith(prompts[i // 2])
            assert mine[-1]["finish_reason"] == want["finish_reason"]
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]

        ranked = c.post("/v1/completions", json={**hot, "prompt": prompts[:2], "n": 1, "best_of": 3}).json()
        for k, p in enumerate(prompts[:2]):
            cands = [c.post("/v1/completions", json={**hot, "prompt": p, "seed": 7 + i, "logprobs": 0}).json()["choices"][0]
                     for i in range(3)]
            best = max(cands, key=lambda ch: sum(ch["logprobs"]["token_logprobs"]))
            assert ranked["choices"][k]["text"] == best["text"] and ranked["choices"][k]["index"] == k
        assert ranked["usage"]["completion_tokens"] == 2 * 3 * 4

        assert error_of(c.post("/v1/completions", json={"prompt": ["a"] * 200, "n": 2}), 400)["param"] == "prompt"
        assert error_of(c.post("/v1/completions", json={"prompt": ["a", ""]}), 400)["param"] == "prompt"
        # 2 slots + a queue of 8: eleven prompts cannot be taken
        assert error_of(c.post("/v1/completions", json={"prompt": ["a"] * 11}), 429)["code"] == "queue_full"


def test_the_prefix_cache_is_saved_on_request(ckpt, tmp_path):
    """POST /save_prefix_cache: keyed servers only, with --prefix-cache-dir; what it writes another engine loads."""
    from mtlqwen.runtime import Engine  # noqa: PLC0415

    with TestClient(app_for(ckpt)) as c:
        wait_ok(c)
        assert error_of(c.post("/save_prefix_cache"), 403)["code"] == "forbidden"
    auth = {"Authorization": "Bearer k"}
    with TestClient(app_for(ckpt, api_key="k")) as c:
        wait_ok(c)
        assert error_of(c.post("/save_prefix_cache", headers=auth), 400)["code"] == "not_supported"
    folder = str(tmp_path / "pc")
    with TestClient(app_for(ckpt, api_key="k", prefix_cache_dir=folder)) as c:
        wait_ok(c)
        r = c.post("/v1/completions", json={"prompt": "abcdefgh" * 4, "max_tokens": 1}, headers=auth)
        assert r.status_code == 200, r.text
        assert c.post("/save_prefix_cache", headers=auth).json() == {"written_entries": 1, "dir": folder}
        engine = Engine(str(ckpt), slots=1, num_blocks=32, block_tokens=16)
        assert engine.load_prefix_cache(folder) == (1, [])
