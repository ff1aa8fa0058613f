"""Reading a reply's tool calls (frontends/tool_calls.py): Qwen3.5's XML blocks and Hermes-style JSON, values
typed by the tool's schema, malformed blocks kept as content, and the incremental splitter giving for any
split of a reply what it gives for the whole reply."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtlqwen.frontends.tool_calls import (CLOSE, OPEN, ToolCall, ToolCallReader, ToolCallSplitter, convert_value,
                                          finish_reason, forced_opening, parse_call, split_tool_calls)

WEATHER = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "where": {"type": "object"}, "hours": {"type": "array"}, "scale": {"type": ["number", "null"]},
    "unit": {"enum": ["c", "f"]}, "level": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}


def xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"{OPEN}\n<function={name}>\n{body}</function>\n{CLOSE}"


def test_a_qwen35_call_is_read_with_values_typed_by_the_schema():
    text = "I'll look it up.\n\n" + xml("get_weather", city="Milan\nItaly", days="3", metric="True",
                                        where='{"lat": 45.5, "tags": ["a"]}', hours="[1, 2]", scale="null",
                                        unit="c", level="7", extra="42")
    content, calls = split_tool_calls(text, WEATHER)
    assert content == "I'll look it up."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Milan\nItaly", "days": 3, "metric": True,
                                              "where": {"lat": 45.5, "tags": ["a"]}, "hours": [1, 2], "scale": None,
                                              "unit": "c", "level": 7, "extra": "42"}  # not in the schema: text


@pytest.mark.parametrize("text, schema, value", [
    ("3", {"type": "integer"}, 3), ("3.0", {"type": "integer"}, 3), ("3.5", {"type": "integer"}, "3.5"),
    (" 2.5 ", {"type": "number"}, 2.5), ("true", {"type": "number"}, "true"), ("FALSE", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"), ("null", {"type": ["integer", "null"]}, None),
    ("null", {"type": ["string", "null"]}, "null"),  # a string is allowed: the model wrote text
    ("5", {"type": ["string", "integer"]}, "5"), ("{bad", {"type": "object"}, "{bad"), ("[1]", {"type": "object"}, "[1]"),
    ("1", {"enum": [1, 2]}, 1), ("1", {"enum": ["1", 2]}, "1"), ("x", None, "x"), ("12", {}, "12"),
    ("1", {"oneOf": [{"type": "boolean"}, {"type": "integer"}]}, 1),
])
def test_convert_value(text, schema, value):
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


def test_hermes_json_calls_and_arguments_given_as_text():
    body = '{"name": "add", "arguments": {"a": 1, "b": "ü"}}'
    assert parse_call(body) == ToolCall("add", '{"a": 1, "b": "ü"}')
    assert parse_call('\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n') == ToolCall("add", '{"a": 1}')
    assert parse_call('{"name": "now"}') == ToolCall("now", "{}")
    for bad in ('{"name": "add", "arguments": [1]}', '{"arguments": {}}', '{"name": ""}', "{nope", "[1]",
                '{"name": "f", "arguments": "not json"}'):
        assert parse_call(bad) is None, bad


def test_lenient_xml_missing_closers_and_what_is_not_a_call():
    assert parse_call("<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n") == ToolCall("f", '{"a": "x", "b": "y"}')
    assert parse_call("<function=f>\n</function>") == ToolCall("f", "{}")
    assert parse_call("<function=f>\n<parameter=a>\n\nkeep\n\n</parameter>\n</function>") == ToolCall("f", '{"a": "\\nkeep\\n"}')
    for bad in ("<function=f>\nstray text\n<parameter=a>\nx\n</parameter>\n</function>",
                "<function=f>\n</function>\ntrailing", "just words", "", "<function=f"):
        assert parse_call(bad) is None, bad


def test_a_block_that_is_not_a_call_stays_content_as_written():
    text = f"before {OPEN}not a call{CLOSE} after"
    assert split_tool_calls(text) == (text, [])
    unclosed = "thinking aloud " + OPEN + "\n<function=f>\n<parameter=a>\n1"
    assert split_tool_calls(unclosed) == (unclosed, [])


def test_whitespace_around_calls_is_not_content_but_a_plain_reply_keeps_its_own():
    two = "\n" + xml("a") + "\n\n" + xml("b", x="1") + "\n"
    assert split_tool_calls(two) == ("", [ToolCall("a", "{}"), ToolCall("b", '{"x": "1"}')])
    assert split_tool_calls("Sure.  \n" + xml("a")) == ("Sure.", [ToolCall("a", "{}")])
    assert split_tool_calls("line one\n\nline two\n") == ("line one\n\nline two\n", [])
    assert split_tool_calls("a " + xml("f") + " b") == ("a b", [ToolCall("f", "{}")])


def test_parallel_false_keeps_the_first_call():
    text = xml("a") + "\n" + xml("b") + "\nand some words"
    assert split_tool_calls(text, parallel=False) == ("\nand some words", [ToolCall("a", "{}")])


def test_finish_reason():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"  # cut short: the client sees that, not a finished call
    assert finish_reason("stop", False) == "stop"


# ---- any split of a reply reads as the whole reply

_WORDS = st.sampled_from(["a", " ", "\n", "<", "<tool_", "<tool_call", "</tool_call>", "x y", "ü", "<function=f>",
                          "\n\n", "tool_call>", "{"])
_TEXT = st.lists(_WORDS, max_size=6).map("".join)
_CALL = st.builds(lambda name, args: ("call", name, args),
                  st.sampled_from(["f", "get_weather", "a.b"]),
                  st.dictionaries(st.sampled_from(["x", "city", "n"]),
                                  st.text(st.sampled_from("ab \n1{}[]\"<>/"), max_size=8)
                                  .filter(lambda v: "</parameter>" not in v and "<parameter=" not in v
                                          and "</function>" not in v and v.strip() == v),
                                  max_size=3))
_SEGMENTS = st.lists(st.one_of(_TEXT.map(lambda t: ("text", t)), _CALL), max_size=6)


def _render(seg) -> str:
    if seg[0] == "text":
        return seg[1]
    return xml(seg[1], **seg[2])


def _expected(segments) -> tuple[str, list[ToolCall]]:
    """The rule by segments: text between calls is content, less the whitespace that only separates it from a
    call or from the end after a call."""
    out, pending, calls = "", "", []
    for seg in segments:
        if seg[0] == "call":
            calls.append(ToolCall(seg[1], json.dumps(seg[2], ensure_ascii=False)))
            pending = ""
            continue
        t = seg[1]
        if not t.strip():
            pending += t
            continue
        out += pending + t.rstrip()
        pending = t[len(t.rstrip()):]
    return out + ("" if calls else pending), calls


def _plain(segments) -> bool:
    """Text segments that cannot open or close a block themselves, alone or with their neighbours."""
    joined = "".join(_render(s) if s[0] == "text" else "\x00" for s in segments)
    return OPEN not in joined and not any(joined.endswith(OPEN[:k]) for k in range(1, len(OPEN))) and \
        all(not piece.endswith(OPEN[:k]) for piece in joined.split("\x00") for k in range(1, len(OPEN)))


@settings(max_examples=300, deadline=None)
@given(_SEGMENTS, st.lists(st.integers(0, 400), max_size=8))
def test_any_split_reads_as_the_whole_reply(segments, cuts):
    text = "".join(_render(s) for s in segments)
    whole = split_tool_calls(text)
    s = ToolCallSplitter()
    content, calls, prev = "", [], 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        c, new = s.feed(text[prev:cut])
        content, calls, prev = content + c, calls + new, cut
    content += s.finish()
    assert (content, calls) == whole
    if _plain(segments):  # nothing in the text segments looks like a tag: the calls and content are exact
        assert whole == _expected(segments)


def test_a_forced_opening_in_either_form_is_continued_by_the_reply():
    assert forced_opening("f", xml=True, opens_thinking=True) == "\n</think>\n\n<tool_call>\n<function=f>\n"
    assert forced_opening("", xml=True, opens_thinking=False) == "<tool_call>\n"
    hermes = forced_opening("f", xml=False, opens_thinking=False)
    assert hermes == '<tool_call>\n{"name": "f", "arguments": '
    from mtlqwen.frontends.reply_text import ReplyText

    def reply(reader, text):  # the forced call's reply, thinking closed by the opening: (content, calls)
        return ReplyText.whole(text, False, reader)[1:]

    reader = ToolCallReader({}, opened=hermes)
    assert reply(reader, '{"a": 1}}\n</tool_call>') == ("", [ToolCall("f", '{"a": 1}')])
    xml_reader = ToolCallReader(WEATHER, opened=forced_opening("get_weather", xml=True, opens_thinking=True))
    assert reply(xml_reader, "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>") == \
        ("", [ToolCall("get_weather", '{"days": 2}')])
    # cut short before the block closed: what stands of it is content, the opening included
    assert reply(xml_reader, "<parameter=days>\n2") == ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2", [])


# ---- the whole reply pipeline: reasoning, then content and calls

@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["\n", "think", " ", "</think>", "\n\n", "answer", OPEN, CLOSE, "<function=f>",
                                 "{\"name\": \"g\"}", "<", "</thi"]), max_size=12),
       st.lists(st.integers(0, 200), max_size=6), st.booleans())
def test_a_streamed_reply_reads_as_the_whole_one(words, cuts, in_reasoning):
    """ReplyText over any split of a reply gives what the whole reply gives: split_reasoning, then the calls."""
    from mtlqwen.frontends.reasoning import split_reasoning
    from mtlqwen.frontends.reply_text import ReplyText

    text = "".join(words)
    reasoning, content = split_reasoning(text, in_reasoning)
    want = (reasoning, *split_tool_calls(content))
    rt, got, prev = ReplyText(in_reasoning, ToolCallReader({})), ["", "", []], 0
    points = sorted(c for c in cuts if c <= len(text)) + [len(text)]
    for k, cut in enumerate(points):
        r, c, calls = rt.feed(text[prev:cut], finished=k == len(points) - 1)
        got = [got[0] + r, got[1] + c, got[2] + calls]
        prev = cut
    assert tuple(got) == want
