"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the serve app in process,
driven by Anthropic's own client over a real tiny engine whose replies to seeded requests are scripted
(frontend_fixtures.ScriptedEngine): the whole message and its event stream read alike, thinking / text /
tool_use blocks and stop reasons, history with tool use and results rendered through the chat template,
thinking switched per request, input tokens counted, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import pytest
from starlette.testclient import TestClient

from frontend_fixtures import app_for, scripted_app, wait_ok, write_tiny_chat_checkpoint
from mtlqwen.frontends.messages_reply import stop_reason

CALLING, PLAIN = 5151, 5252
SCRIPTS = {
    CALLING: ("Two cities.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    PLAIN: "Short.\n</think>\n\nIt is sunny in Milan.",
}
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
ASK = dict(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "Weather in Milan?"}])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with scripted_app(tmp_path_factory.mktemp("messages-ckpt"), SCRIPTS) as (c, engine):
        client = anthropic.Anthropic(api_key="unused", base_url=str(c.base_url), http_client=c, max_retries=0)
        yield client, c, engine


def _prompt(engine, rid: str) -> str:
    return engine.engine.tokenizer.decode(engine.prompts[rid])


def test_a_reply_with_thinking_text_and_a_call(served):
    client, _, engine = served
    m = client.messages.create(**ASK, tools=TOOLS, extra_body={"seed": CALLING, "temperature": 0.5})
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Two cities." and m.content[1].text == "Checking."
    use = m.content[2]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Milan", "days": 3}
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert m.usage.output_tokens == -(-len(SCRIPTS[CALLING]) // 7) and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(engine.prompts[m.id])
    assert json.dumps(TOOLS[0]["input_schema"]) in _prompt(engine, m.id)  # the schema reached the template


@pytest.mark.parametrize("seed, tools", [(CALLING, TOOLS), (PLAIN, None)])
def test_the_stream_builds_the_same_message(served, seed, tools):
    client, c, _ = served
    extra = {"tools": tools} if tools else {}
    whole = client.messages.create(**ASK, **extra, extra_body={"seed": seed, "temperature": 0.5})
    with client.messages.stream(**ASK, **extra, extra_body={"seed": seed, "temperature": 0.5}) as s:
        streamed = s.get_final_message()
    strip = lambda m: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]  # noqa: E731
    assert strip(streamed) == strip(whole)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    # the raw events: message_start, each block's start / deltas / stop in turn, message_delta, message_stop
    body = {**ASK, **extra, "seed": seed, "temperature": 0.5, "stream": True}
    with c.stream("POST", "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["index"] for d in datas if d["type"] == "content_block_start"]
    stops = [d["index"] for d in datas if d["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(whole.content)))


def test_tool_use_and_results_in_the_history_render(served):
    client, _, engine = served
    history = [
        {"role": "user", "content": "Weather in Milan?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Milan", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    m = client.messages.create(**{**ASK, "messages": history}, tools=TOOLS, system="Be brief.",
                               extra_body={"seed": PLAIN, "temperature": 0.5})
    prompt = _prompt(engine, m.id)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>") in prompt
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>" in prompt
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"


def test_thinking_off_and_a_forced_tool(served):
    client, _, engine = served
    m = client.messages.create(**ASK, thinking={"type": "disabled"}, extra_body={"seed": PLAIN, "temperature": 0.5})
    assert _prompt(engine, m.id).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    m = client.messages.create(**ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                               extra_body={"seed": PLAIN, "temperature": 0.5})
    assert _prompt(engine, m.id).endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")


def test_count_tokens_is_the_prompt_the_server_renders(served):
    client, _, engine = served
    n = client.messages.count_tokens(model="tiny", messages=ASK["messages"], tools=TOOLS)
    m = client.messages.create(**ASK, tools=TOOLS, extra_body={"seed": PLAIN, "temperature": 0.5})
    assert n.input_tokens == len(engine.prompts[m.id])


@pytest.mark.parametrize("patch, kind, words", [
    ({"max_tokens": None}, "invalid_request_error", "'max_tokens' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "invalid_request_error",
     "'image' content blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "invalid_request_error", "'messages[0].content[0].text' is required"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "invalid_request_error", "server tool"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "invalid_request_error", "not one of the"),
    ({"model": "claude-sonnet"}, "not_found_error", "does not exist"),
])
def test_errors_come_in_anthropics_shape(served, patch, kind, words):
    _, c, _ = served
    body = {k: v for k, v in {**ASK, **patch}.items() if v is not None}
    r = c.post("/v1/messages", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err


def test_the_client_raises_its_own_errors(served):
    client, _, _ = served
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**ASK, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})


def test_stop_reasons():
    out = lambda **kw: SimpleNamespace(**{"finish_reason": "stop", "stop_reason": None, **kw})  # noqa: E731
    assert stop_reason(out(), called=False) == ("end_turn", None)
    assert stop_reason(out(), called=True) == ("tool_use", None)
    assert stop_reason(out(stop_reason="END"), called=False) == ("stop_sequence", "END")
    assert stop_reason(out(stop_reason=7), called=False) == ("end_turn", None)  # a stop token id: not a sequence
    assert stop_reason(out(finish_reason="length"), called=True) == ("max_tokens", None)


def test_a_keyed_server_takes_anthropics_key_header(tmp_path):
    ckpt = write_tiny_chat_checkpoint(tmp_path / "ckpt", eos_reachable=False)
    with TestClient(app_for(ckpt, api_key="sekret", num_blocks=64)) as c:
        wait_ok(c)
        r = c.post("/v1/messages", json=ASK)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(api_key="wrong", base_url=str(c.base_url), http_client=c, max_retries=0).messages.create(**ASK)
        client = anthropic.Anthropic(api_key="sekret", base_url=str(c.base_url), http_client=c, max_retries=0)
        m = client.messages.create(**{**ASK, "max_tokens": 3}, extra_body={"temperature": 0})
        assert m.usage.output_tokens == 3 and m.stop_reason == "max_tokens"


def test_a_stop_sequence_is_named_as_what_stopped_the_reply(tmp_path):
    """Through the real engine: the greedy reply's own text, cut at a stop sequence taken from it, ends with
    stop_reason stop_sequence and that string (the engine's Output.stop_reason)."""
    ckpt = write_tiny_chat_checkpoint(tmp_path / "ckpt", eos_reachable=False)
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "thinking": {"type": "disabled"}}
    with TestClient(app_for(ckpt, num_blocks=64)) as c:
        wait_ok(c)
        full = c.post("/v1/messages", json=ask).json()
        text = full["content"][0]["text"]
        assert full["stop_reason"] == "max_tokens" and len(text) >= 6, full
        stop = text[3:5]
        cut = c.post("/v1/messages", json={**ask, "stop_sequences": ["never-there", stop]}).json()
        assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
        assert cut["content"][0]["text"] == text[:text.index(stop)]
