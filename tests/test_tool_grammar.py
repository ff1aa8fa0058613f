"""A forced tool call's grammar (frontends/tool_grammar.py): for random tools and arguments their schemas allow,
the call written as the template writes it is accepted, token by token, and tool_calls.py reads back those
arguments; a wrong type, a missing required parameter, an unknown tool or text after the calls is not."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_fixtures import write_tiny_chat_checkpoint
from mtlqwen.frontends.tool_calls import CLOSE, OPEN, forced_opening, parse_call
from mtlqwen.frontends.tool_grammar import call_grammar
from mtlqwen.runtime.structured import Constraints, Structure
from mtlqwen.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def constraints(tmp_path_factory):
    tok = load_tokenizer(write_tiny_chat_checkpoint(tmp_path_factory.mktemp("grammar")))
    return tok, Constraints(tok, 272, tok.eos_token_ids)


def accepts(constraints, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` token by token and may end there (EOS allowed)."""
    tok, cons = constraints
    m = cons.matcher(Structure("lark", grammar))
    for t in tok.encode_literal(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
# text values: anything but the markers the reader stops at (and the trimmed newlines at their ends)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20).filter(
    lambda s: not any(m in s for m in ("</parameter>", "<parameter=", "</function>")) and not s.startswith("\n")
    and not s.endswith("\n"))
KINDS = {
    "string": ({"type": "string"}, TEXT),
    "integer": ({"type": "integer"}, st.integers(-10**6, 10**6)),
    "number": ({"type": "number"}, st.floats(-1e3, 1e3, allow_nan=False).map(lambda x: round(x, 3))),
    "boolean": ({"type": "boolean"}, st.booleans()),
    "enum": ({"type": "string", "enum": ["red", "green", "blue"]}, st.sampled_from(["red", "green", "blue"])),
    "object": ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
               st.integers(0, 99).map(lambda n: {"n": n})),
    "array": ({"type": "array", "items": {"type": "string"}}, st.lists(st.sampled_from(["a", "b c"]), max_size=3)),
}


@st.composite
def tools(draw):
    """{tool: (schema, {param: strategy})} with 1-3 tools of 0-4 parameters, a random subset required."""
    out = {}
    for name in draw(st.lists(NAMES, min_size=1, max_size=3, unique=True)):
        params = draw(st.lists(NAMES, max_size=4, unique=True))
        kinds = [draw(st.sampled_from(sorted(KINDS))) for _ in params]
        required = [p for p in params if draw(st.booleans())]
        schema = {"type": "object", "properties": {p: KINDS[k][0] for p, k in zip(params, kinds)}, "required": required}
        out[name] = (schema, {p: KINDS[k][1] for p, k in zip(params, kinds)})
    return out


def xml_value(v) -> str:
    """As the Qwen3.5 template writes a value: JSON for objects and arrays, Python's str otherwise."""
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def xml_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in args.items())
    return f"<function={name}>\n{params}</function>"


@st.composite
def calls(draw, tls):
    """1-3 calls: (tool, arguments in schema order, optional ones present or not)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(tls)))
        schema, values = tls[name]
        args = {p: draw(values[p]) for p in schema["properties"] if p in schema["required"] or draw(st.booleans())}
        out.append((name, args))
    return out


def rest_of(opening: str, whole: str) -> str:
    assert whole.startswith(opening)
    return whole[len(opening):]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), named=st.booleans(), xml=st.booleans())
def test_calls_as_the_template_writes_them_are_accepted_and_read_back(constraints, data, named, xml):
    tls = data.draw(tools())
    cs = data.draw(calls(tls))
    name = cs[0][0] if named else ""
    schemas = {n: s for n, (s, _) in tls.items()}
    opening = forced_opening(name, xml, opens_thinking=False)
    if xml:
        blocks = [f"{OPEN}\n{xml_call(n, a)}\n{CLOSE}" for n, a in cs]
    else:
        blocks = [f"{OPEN}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + f"\n{CLOSE}" for n, a in cs]
    reply = rest_of(opening, "\n".join(blocks))
    assert accepts(constraints, call_grammar(schemas, name, xml, parallel=True), reply), reply
    assert accepts(constraints, call_grammar(schemas, name, xml, parallel=False), rest_of(opening, blocks[0]))
    if len(cs) > 1:  # one call only without parallel_tool_calls
        assert not accepts(constraints, call_grammar(schemas, name, xml, parallel=False), reply)
    for block, (n, a) in zip(blocks, cs):  # and the reader reads the arguments the schema allowed
        call = parse_call(block[len(OPEN):-len(CLOSE)], schemas)
        assert call is not None and call.name == n and json.loads(call.arguments) == a, (block, call)


SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "metric": {"type": "boolean"}},
                           "required": ["city"]},
           "ping": {}}


@pytest.mark.parametrize("reply, ok", [
    ("<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>", True),
    ("<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n"
     "</parameter>\n</function>\n</tool_call>", True),
    ("<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n"
     "</tool_call>", True),
    ("<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", False),  # city is required
    ("<parameter=city>\nOslo\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>", False),
    ("<parameter=city>\nOs</parameter>lo\n</parameter>\n</function>\n</tool_call>", False),
    ("<parameter=city>\nOslo\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>", False),
    ("<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=nope>\n", False),
    ("<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\nDone.", False),
])
def test_named_xml_call(constraints, reply, ok):
    assert accepts(constraints, call_grammar(SCHEMAS, "get_weather", xml=True, parallel=True), reply) is ok


def test_named_json_call(constraints):
    g = call_grammar(SCHEMAS, "get_weather", xml=False, parallel=True)
    assert accepts(constraints, g, '{"city": "Oslo", "days": 2}}\n</tool_call>')
    assert not accepts(constraints, g, '{"days": 2}}\n</tool_call>')
    assert not accepts(constraints, g, '{"city": 5}}\n</tool_call>')


def test_a_schema_llguidance_cannot_compile_leaves_the_call_unheld(caplog):
    from types import SimpleNamespace  # noqa: PLC0415

    from mtlqwen.frontends.prompt_limits import forced_call_grammar  # noqa: PLC0415

    bad = {"type": "object", "properties": {"x": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}
    req = SimpleNamespace(tools=[{"type": "function", "function": {"name": "f", "parameters": bad}}], forced_call="f",
                          parallel_tool_calls=True)
    with caplog.at_level("WARNING", logger="mtlqwen.serve"):
        assert forced_call_grammar(req, xml=True) is None
    assert "runs without its grammar" in caplog.text and "strnig" in caplog.text
    req.tools[0]["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert "%json" in forced_call_grammar(req, xml=True)
