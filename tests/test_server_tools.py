"""Tools through the serve app in process (starlette's TestClient) over a real tiny engine whose reply to a
request seeded SCRIPTED is a fixed Qwen3.5 reply, a few characters a step: the tools reach the chat template,
the reply's calls come back as OpenAI `tool_calls` (whole and streamed alike), past calls and tool results
render, and what the server cannot honour is refused."""

from __future__ import annotations

import json

import pytest

from frontend_fixtures import IM_END, scripted_app

SCRIPTED, FORCED, FORCED_ANY = 4242, 4343, 4444
REPLY = ("The user wants the weather.\n</think>\n\nChecking both cities.\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nMilan\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>")
# the rest of a call whose opening the prompt holds: a named tool_choice (FORCED), "required" (FORCED_ANY)
FORCED_REPLY = "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
SCRIPTS = {SCRIPTED: REPLY, FORCED: FORCED_REPLY, FORCED_ANY: "<function=get_weather>\n" + FORCED_REPLY}
PIECE = 7  # characters of the script a step
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <|im_end|> in the coming days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ASK = {"messages": [{"role": "user", "content": "Weather in Milan and Oslo?"}], "max_tokens": 200,
       "seed": SCRIPTED, "temperature": 0.5, "tools": TOOLS}
CALLS = [{"name": "get_weather", "arguments": {"city": "Milan", "days": 3}},
         {"name": "get_weather", "arguments": {"city": "Oslo"}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with scripted_app(tmp_path_factory.mktemp("tools-ckpt"), SCRIPTS, PIECE) as (c, engine):
        yield c, engine


def _calls(tool_calls: list[dict]) -> list[dict]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in tool_calls)
    assert len({c["id"] for c in tool_calls}) == len(tool_calls)
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in tool_calls]


def _prompt_text(engine, rid: str) -> str:
    return engine.engine.tokenizer.decode(engine.prompts[rid])


def test_a_reply_with_calls_comes_back_as_tool_calls(served):
    c, engine = served
    r = c.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking both cities."
    assert msg["reasoning_content"] == "The user wants the weather."
    assert _calls(msg["tool_calls"]) == CALLS
    prompt = _prompt_text(engine, body["id"])
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # the schemas reached the template
    # a special-token string in a tool's description stays characters: the prompt's <|im_end|> tokens are the
    # template's own (the tools' system turn and the user turn)
    assert engine.prompts[body["id"]].count(IM_END) == 2


def test_streamed_calls_equal_the_whole_reply(served):
    c, _ = served
    with c.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    streamed = [t for d in deltas for t in d.get("tool_calls") or []]
    assert content == "Checking both cities." and reasoning.strip("\n") == "The user wants the weather."
    assert [t["index"] for t in streamed] == [0, 1]
    assert _calls(streamed) == CALLS
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_tool_choice_none_leaves_the_reply_as_text(served):
    c, _ = served
    msg = c.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()["choices"][0]
    assert msg["finish_reason"] == "stop" and "tool_calls" not in msg["message"]
    assert msg["message"]["content"] == REPLY.split("\n\n", 1)[1]


def test_parallel_tool_calls_false_keeps_the_first(served):
    c, _ = served
    msg = c.post("/v1/chat/completions", json={**ASK, "parallel_tool_calls": False}).json()["choices"][0]["message"]
    assert _calls(msg["tool_calls"]) == CALLS[:1]


def test_past_calls_and_tool_results_render(served):
    c, engine = served
    history = [
        {"role": "user", "content": "Weather in Milan?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Milan\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = c.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = _prompt_text(engine, r.json()["id"])
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>") in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize("choice, opening", [
    ("required", "<tool_call>\n"),  # the model picks the function
    ({"type": "function", "function": {"name": "get_weather"}}, "<tool_call>\n<function=get_weather>\n"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_choice_opens_the_call_in_the_prompt(served, choice, opening, stream):
    c, engine = served
    body = {**ASK, "seed": FORCED_ANY if choice == "required" else FORCED, "tool_choice": choice, "stream": stream}
    if stream:
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line and line != "data: [DONE]"]
        rid = events[0]["id"]
        deltas = [e["choices"][0]["delta"] for e in events]
        calls = [t for d in deltas for t in d.get("tool_calls") or []]
        content = "".join(d.get("content") or "" for d in deltas)
        reason = events[-1]["choices"][0]["finish_reason"]
    else:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        rid, choice0 = r.json()["id"], r.json()["choices"][0]
        calls, content, reason = choice0["message"].get("tool_calls"), choice0["message"]["content"], choice0["finish_reason"]
    prompt = _prompt_text(engine, rid)
    # thinking closed as the template does with it off, then the call opened in Qwen3.5's form
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + opening)
    tok = engine.engine.tokenizer
    tail = [tok.token_to_id("<tool_call>"), *tok.encode_literal(opening[len("<tool_call>"):])]
    assert engine.prompts[rid][-len(tail):] == tail  # the opening's <tool_call> is the control token
    assert _calls(calls) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert not content and reason == "tool_calls"


@pytest.mark.parametrize("patch, param, code", [
    ({"tool_choice": "required", "tools": None}, "tool_choice", None),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name", None),
    ({"tool_choice": "sometimes"}, "tool_choice", None),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", None),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "guided_regex": "a+"}, "guided_regex",
     None),
    ({"functions": [{"name": "f"}]}, "functions", "not_supported"),
    ({"tools": TOOLS * 2}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", None),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", None),
    ({"tools": [{"type": "function"}]}, "tools[0].function", None),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     "messages[1].tool_calls[0].function", None),
])
def test_what_cannot_be_honoured_is_refused(served, patch, param, code):
    c, _ = served
    r = c.post("/v1/chat/completions", json={**ASK, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def test_a_raw_prompt_takes_no_tools(served):
    c, _ = served
    r = c.post("/v1/completions", json={"prompt": "x", "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


CHOICES = [{"type": "function", "function": {
    "name": "set_light", "description": "Set a lamp",
    "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["hall", "kitchen"]},
                                                    "on": {"type": "boolean"}, "level": {"type": "integer"}},
                   "required": ["room", "on"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_light"}}])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_call_from_the_real_model_is_held_to_the_schema(served, choice, seed):
    """The tiny random model writes noise; under a forced tool_choice the grammar makes its reply calls that parse,
    every argument of its schema's type, each required one present."""
    c, _ = served
    body = {"messages": [{"role": "user", "content": "Lights?"}], "tools": CHOICES, "tool_choice": choice,
            "seed": seed, "temperature": 1.0, "max_tokens": 400, "parallel_tool_calls": seed != 3}
    msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and not (msg["message"]["content"] or "").strip(), msg
    calls = _calls(msg["message"]["tool_calls"])
    assert calls and (len(calls) == 1 or seed != 3)
    if isinstance(choice, dict):
        assert calls[0]["name"] == "set_light"
    for call in calls:
        args = call["arguments"]
        if call["name"] == "ping":
            assert args == {}
            continue
        assert {"room", "on"} <= set(args) <= {"room", "on", "level"}, args
        assert args["room"] in ("hall", "kitchen") and isinstance(args["on"], bool)
        assert isinstance(args.get("level", 0), int)
