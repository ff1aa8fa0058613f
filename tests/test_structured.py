"""Structured outputs (runtime/structured.py) on the CPU, a tiny random model with a real byte-level tokenizer:
every greedy token is the model's best among the tokens llguidance allows there (the model run alone, masked by
a matcher the test drives itself), whatever the batching and preemptions; the replies parse as their grammar
says; a grammar's end ends the reply; `after` leaves the reply free until its token; bad grammars are refused
at submit; constrained requests never draft."""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pytest

from engine_checks import near_tie, ref_logits, run_arrivals
from frontend_fixtures import write_tiny_chat_checkpoint
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.structured import Structure

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}
STRUCTURES = [Structure("json_schema", json.dumps(SCHEMA)), Structure("regex", "[a-c]{2,4}x"),
              Structure("choice", '["red", "green", "blue"]'), Structure("lark", 'start: "(" ("a" | "b")~3 ")"')]


def parses(s: Structure, text: str) -> bool:
    if s.format == "json_schema":
        v = json.loads(text)
        return set(v) == {"answer", "n"} and v["answer"] in ("yes", "no") and 0 <= v["n"] <= 99
    if s.format == "regex":
        return re.fullmatch(s.text, text) is not None
    if s.format == "choice":
        return text in json.loads(s.text)
    return re.fullmatch(r"\([ab]{3}\)", text) is not None


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from mtlqwen import load
    from mtlqwen.tokenizer import load_tokenizer

    ckpt = write_tiny_chat_checkpoint(tmp_path_factory.mktemp("structured"), eos_reachable=False)
    return load(str(ckpt)), load_tokenizer(ckpt)


def reference_masks(tok, vocab: int, s: Structure, tokens: list[int]) -> list[np.ndarray]:
    """The tokens llguidance allows before each of `tokens`, by a matcher driven here."""
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=[258, 256])
    m = llguidance.LLMatcher(lt, s.grammar())
    out = []
    for t in tokens:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        out.append(((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[:vocab].astype(bool))
        assert m.consume_token(t)
    return out


def test_greedy_tokens_are_the_best_allowed_and_replies_parse(chat):
    model, tok = chat
    V = model.config.vocab_size
    prompts = [tok.encode(p) for p in ("tell me " * 5, "a longer prompt that spans two blocks of sixteen", "x", "ok?" * 9)]
    reqs = [(k % 3, prompts[k % 4], SamplingParams(max_tokens=40, structured=STRUCTURES[k % 4]))
            for k in range(6)] + [(1, prompts[1], SamplingParams(max_tokens=12, ignore_eos=True))]
    eng = Engine(model, tokenizer=tok, slots=3, step_tokens=16, block_tokens=16, num_blocks=6, prefix_interval=0)
    outs = run_arrivals(eng, reqs)
    assert eng.stats()["preemptions"] > 0
    for (_, prompt, p), out in zip(reqs, outs):
        if p.structured is None:  # an unconstrained neighbour is the request alone
            alone = Engine(model, tokenizer=tok, slots=1, prefix_interval=0).generate([prompt], p)[0]
            assert out.token_ids == alone.token_ids
            continue
        assert out.finish_reason == "stop" and parses(p.structured, out.text), (p.structured.format, out.text)
        rows = ref_logits(model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
        for k, (t, row, allowed) in enumerate(zip(out.token_ids, rows,
                                                   reference_masks(tok, V, p.structured, out.token_ids))):
            x = np.where(allowed, row, -np.inf)
            best = int(x.argmax())
            assert allowed[t] and (t == best or x[best] - x[t] <= near_tie() * np.abs(row).max()), (k, t, best)


def test_the_end_of_the_grammar_ends_the_reply_even_ignoring_eos(chat):
    model, tok = chat
    eng = Engine(model, tokenizer=tok, slots=1, prefix_interval=0)
    out = eng.generate([tok.encode("hi")], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=1,
                                                          structured=Structure("choice", '["alpha", "beta"]')))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop" and len(out.token_ids) == len(out.text)


def test_after_leaves_the_reply_free_until_its_token(chat):
    """A logit bias makes the model write `after` first (a stand-in for the end of its thinking); from there the
    reply is one of the choices, the bias notwithstanding."""
    model, tok = chat
    end = tok.token_to_id("</think>")
    p = SamplingParams(max_tokens=20, logit_bias={end: 100},
                       structured=Structure("choice", '["red", "green"]', after=end))
    out = Engine(model, tokenizer=tok, slots=1, prefix_interval=0).generate([tok.encode("hi")], p)[0]
    assert out.token_ids[0] == end and out.text[len("</think>"):] in ("red", "green") and out.finish_reason == "stop"


@pytest.mark.parametrize("s, words", [
    (Structure("json_schema", '{"type": "nope"}'), "json_schema"), (Structure("json_schema", "{not json"), "json_schema"),
    (Structure("regex", "(unclosed"), "regex"), (Structure("choice", '"red"'), "choice"),
    (Structure("lark", "start: undefined_rule"), "lark"),
])
def test_bad_grammars_are_refused_at_submit(chat, s, words):
    model, tok = chat
    with pytest.raises(ValueError, match=words):
        Engine(model, tokenizer=tok, slots=1).submit(tok.encode("x"), SamplingParams(structured=s))


def test_the_structure_is_checked_and_never_drafts():
    with pytest.raises(ValueError, match="one of"):
        SamplingParams(structured=Structure("xml", "<a/>"))
    with pytest.raises(ValueError, match="Structure"):
        SamplingParams(structured={"format": "regex", "text": "a"})
    assert not SamplingParams(structured=STRUCTURES[1]).drafts and SamplingParams().drafts
