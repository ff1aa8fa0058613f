"""OpenAI's Responses API (`/v1/responses`) through the serve app in process, driven by the official client over a
real tiny engine whose replies to seeded requests are scripted (frontend_fixtures.ScriptedEngine): the whole
response and its event stream build the same output items (reasoning, message, function calls), input items
render through the chat template, text.format holds the reply to a schema, stored responses are continued,
retrieved and deleted, and other inputs are refused."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from frontend_fixtures import app_for, scripted_app, wait_ok, write_tiny_chat_checkpoint

CALLING, PLAIN = 6161, 6262
SCRIPTS = {
    CALLING: ("Two cities.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    PLAIN: "Short.\n</think>\n\nIt is sunny in Milan.",
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with scripted_app(tmp_path_factory.mktemp("responses-ckpt"), SCRIPTS) as (c, engine):
        yield openai.OpenAI(api_key="unused", base_url=str(c.base_url) + "/v1", http_client=c, max_retries=0), c, engine


def _items(resp) -> list[dict]:
    """Output items without their ids (the stream and the whole response draw their own)."""
    return [{k: v for k, v in it.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for it in resp.output]


@pytest.mark.parametrize("seed, tools", [(CALLING, TOOLS), (PLAIN, None)])
def test_the_stream_builds_the_whole_response(served, seed, tools):
    client, _, _ = served
    kw = dict(model="tiny", input="Weather in Milan?", max_output_tokens=200, temperature=0.5,
              extra_body={"seed": seed}, **({"tools": tools} if tools else {}))
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        streamed = s.get_final_response()
    assert _items(streamed) == _items(whole) and streamed.status == whole.status == "completed"
    assert whole.id.startswith("resp_") and whole.usage.output_tokens > 0
    if tools:
        assert [it.type for it in whole.output] == ["reasoning", "message", "function_call"]
        call = whole.output[2]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Milan", "days": 3}
        assert whole.output[1].content[0].text == "Checking."
    else:
        assert [it.type for it in whole.output] == ["reasoning", "message"]
        assert whole.output_text == "It is sunny in Milan."
        assert whole.output[0].content[0].text == "Short."


def test_input_items_render_through_the_template(served):
    client, _, engine = served
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Milan?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Milan"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(model="tiny", input=items, tools=TOOLS, max_output_tokens=50, temperature=0.5,
                                extra_body={"seed": PLAIN})
    prompt = engine.engine.tokenizer.decode(engine.prompts[r.id])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<think>\nlook it up\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_a_schema_and_thinking_off(tmp_path):
    """No script: the tiny model itself, held to a schema, with reasoning effort "none" (thinking off)."""
    ckpt = write_tiny_chat_checkpoint(tmp_path / "ckpt", eos_reachable=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with TestClient(app_for(ckpt, num_blocks=64)) as c:
        wait_ok(c)
        client = openai.OpenAI(api_key="x", base_url=str(c.base_url) + "/v1", http_client=c, max_retries=0)
        r = client.responses.create(model="tiny", input="hi", max_output_tokens=30, reasoning={"effort": "none"},
                                    text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
        assert [it.type for it in r.output] == ["message"] and json.loads(r.output_text) in ({"ok": True}, {"ok": False})
        cut = client.responses.create(model="tiny", input="hi", max_output_tokens=3, reasoning={"effort": "none"})
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        with client.responses.stream(model="tiny", input="hi", max_output_tokens=3, reasoning={"effort": "none"}) as s:
            events = list(s)  # the API ends a cut stream with response.incomplete, not response.completed
        assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
        assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("patch, param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
])
def test_what_needs_state_or_other_inputs_is_refused(served, patch, param):
    _, c, _ = served
    r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", **patch})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_stored_response_is_continued_retrieved_and_deleted(served):
    """previous_response_id renders the conversation the client would have sent whole (the earlier instructions
    not carried over); GET returns the stored body, streamed responses included; store=false keeps nothing."""
    client, c, engine = served
    kw = dict(model="tiny", max_output_tokens=60, temperature=0.5, extra_body={"seed": PLAIN})
    raw = c.post("/v1/responses", json={"model": "tiny", "input": "Weather in Milan?", "instructions": "Be brief.",
                                        "max_output_tokens": 60, "temperature": 0.5, "seed": PLAIN}).json()
    assert c.get(f"/v1/responses/{raw['id']}").json() == raw
    first = client.responses.retrieve(raw["id"])
    assert first.output_text == "It is sunny in Milan."
    second = client.responses.create(input="And Oslo?", previous_response_id=first.id, **kw)
    whole = client.responses.create(input=[{"role": "user", "content": "Weather in Milan?"},
                                           *[it.model_dump(exclude_none=True) for it in first.output],
                                           {"role": "user", "content": "And Oslo?"}], **kw)
    assert engine.prompts[second.id] == engine.prompts[whole.id]
    assert "Be brief." not in engine.engine.tokenizer.decode(engine.prompts[second.id])
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, **kw)  # a chain of three
    chain = client.responses.create(input=[{"role": "user", "content": "Weather in Milan?"},
                                           *[it.model_dump(exclude_none=True) for it in first.output],
                                           {"role": "user", "content": "And Oslo?"},
                                           *[it.model_dump(exclude_none=True) for it in second.output],
                                           {"role": "user", "content": "Thanks."}], **kw)
    assert engine.prompts[third.id] == engine.prompts[chain.id]

    with client.responses.stream(input="hi", **kw) as s:
        streamed = s.get_final_response()
    assert c.get(f"/v1/responses/{streamed.id}").json()["output"][-1]["content"][0]["text"] == streamed.output_text

    unstored = client.responses.create(input="hi", store=False, **kw)
    assert c.get(f"/v1/responses/{unstored.id}").status_code == 404
    r = c.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": unstored.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert c.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response.deleted",
                                                            "deleted": True}
    assert c.get(f"/v1/responses/{first.id}").status_code == c.delete(f"/v1/responses/{first.id}").status_code == 404
    assert client.responses.create(input="more", previous_response_id=second.id, **kw).status == "completed"


def test_the_store_keeps_the_most_recent():
    from mtlqwen.frontends.response_store import ResponseStore  # noqa: PLC0415

    store = ResponseStore(2)
    for i in range(3):
        store.keep({"id": f"r{i}"}, [{"n": i}])
    assert store.body("r0") is None and store.conversation("r1") == [{"n": 1}]  # r1 now the most recent
    store.keep({"id": "r3"}, [])
    assert (store.body("r2"), store.body("r1"), len(store)) == (None, {"id": "r1"}, 2)
    off = ResponseStore(0)
    off.keep({"id": "x"}, [])
    assert off.body("x") is None and len(off) == 0
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(-1)
