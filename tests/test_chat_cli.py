"""`mtlqwen chat` driven through a pseudo-terminal (pexpect): two turns whose token history only grows
at the end (what a prefix cache needs), Ctrl-C cancelling a reply, Ctrl-C / Ctrl-D exiting, unknown
commands, and the context rule (a reply budget trimmed to the room left, a full conversation refused).
Tiny random model on CPU; every expect has a timeout."""

from __future__ import annotations

import inspect
import json
import sys

import pexpect
import pytest

from cli_fixtures import BEL, RESERVED, write_noisy_checkpoint
from frontend_fixtures import IM_END, REPO, subprocess_env, write_tiny_chat_checkpoint
from mtlqwen import load_tokenizer
from mtlqwen.frontends.chat import DIM, RESET
from mtlqwen.frontends.metrics import PREFIX_HIT_KEYS, first_stat
from mtlqwen.runtime import Engine

PROMPT = ">> "
HAS_PREFIX_CACHE = "prefix_interval" in inspect.signature(Engine.__init__).parameters


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat-ckpt"))


@pytest.fixture(scope="module")
def endless_ckpt(tmp_path_factory):
    """Replies never end by EOS, so a long one is still streaming when Ctrl-C arrives."""
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("endless-ckpt"), eos_reachable=False)


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "mtlqwen", "chat", *args], cwd=str(REPO), env=subprocess_env(),
                          timeout=60, encoding="utf-8", codec_errors="replace", dimensions=(40, 200))
    return child


def finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    return child.exitstatus


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_turns_extend_the_same_tokens(ckpt, tmp_path):
    log = tmp_path / "turns.jsonl"
    extra = ["--prefix-interval", "16"] if HAS_PREFIX_CACHE else []
    child = spawn("--model", str(ckpt), "--max-tokens", "12", "--system-prompt", "You are terse.",
                  "--debug-token-log", str(log), *extra)
    try:
        child.expect_exact(PROMPT)
        child.sendline("Hello there")
        child.expect_exact(PROMPT)
        child.sendline("And a second question?")
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl-D at the prompt quits
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    t1, t2 = read_log(log)
    first = t1["prompt_ids"] + t1["completion_ids"]
    # the precondition for a prefix-cache hit: turn 2's prompt starts with all of turn 1's tokens
    assert t2["prompt_ids"][: len(first)] == first and len(t2["prompt_ids"]) > len(first)
    tok = load_tokenizer(ckpt)
    tail = tok.decode(t2["prompt_ids"][len(first):])
    assert "<|im_start|>user\nAnd a second question?<|im_end|>\n" in tail
    assert tail.endswith("<|im_start|>assistant\n<think>\n")
    if t1["completion_ids"][-1] != IM_END:  # a reply cut by max-tokens gets the template's turn end
        assert t2["prompt_ids"][len(first)] == IM_END
    assert tok.decode(t1["prompt_ids"]).startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    if HAS_PREFIX_CACHE:
        hits = t2["cached_tokens"] or first_stat(t2["stats"], PREFIX_HIT_KEYS)
        assert hits > 0, t2["stats"]


def test_thinking_toggle_changes_the_generation_prompt(ckpt, tmp_path):
    log = tmp_path / "turns.jsonl"
    child = spawn("--model", str(ckpt), "--max-tokens", "4", "--debug-token-log", str(log))
    try:
        child.expect_exact(PROMPT)
        child.sendline("/no_think")
        child.expect_exact("thinking off")
        child.expect_exact(PROMPT)
        child.sendline("hi")
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    (t1,) = read_log(log)
    text = load_tokenizer(ckpt).decode(t1["prompt_ids"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_ctrl_c_cancels_the_reply_then_exits(endless_ckpt, tmp_path):
    log = tmp_path / "turns.jsonl"
    child = spawn("--model", str(endless_ckpt), "--max-tokens", "600", "--debug-token-log", str(log), "--verbose")
    try:
        child.expect_exact(PROMPT)
        child.sendline("Tell me everything.")
        child.expect_exact("Tell me everything.")  # the terminal's echo of the line
        child.expect(r"[\s\S]{20}", timeout=30)  # then the reply is streaming
        child.sendintr()
        child.expect_exact("(reply cancelled)", timeout=30)
        child.expect_exact(PROMPT)
        child.sendline("short one")
        # the reply's end is its stats line (--verbose): the random reply itself may contain ">> "
        child.expect(r"reply \d+ tokens", timeout=90)
        child.expect_exact(PROMPT, timeout=30)
        child.sendintr()  # Ctrl-C at the prompt quits
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    turns = read_log(log)
    # the cancelled turn left no trace: the next turn is a fresh conversation
    assert len(turns) == 1 and turns[0]["turn"] == 1
    text = load_tokenizer(endless_ckpt).decode(turns[0]["prompt_ids"])
    assert text == "<|im_start|>user\nshort one<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_unknown_commands_do_not_reach_the_model(ckpt, tmp_path):
    log = tmp_path / "turns.jsonl"
    child = spawn("--model", str(ckpt), "--max-tokens", "4", "--debug-token-log", str(log))
    try:
        child.expect(r"loading: +100%")  # the load's progress bar, on a terminal
        child.expect_exact(PROMPT)
        child.sendline("/bogus")
        child.expect_exact("(unknown command '/bogus'; /help lists them)")
        child.expect_exact(PROMPT)
        child.sendline("/reset please")
        child.expect_exact("(/reset takes no arguments; /help lists the commands)")
        child.expect_exact(PROMPT)
        child.sendline("//etc is a message")  # a leading // sends a message that starts with /
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    (t1,) = read_log(log)  # only the // line reached the model
    text = load_tokenizer(ckpt).decode(t1["prompt_ids"])
    assert text == "<|im_start|>user\n/etc is a message<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_a_reply_budget_beyond_the_context_is_refused_at_start(ckpt):
    child = spawn("--model", str(ckpt), "-m", "3000")
    try:
        assert finish(child) == 1
    finally:
        child.terminate(force=True)
    out = child.before
    assert ("mtlqwen chat: error: --max-tokens 3000 does not fit the model's context of 2048 tokens (the prompt "
            "and the reply share it): use --max-tokens 2047 or less") in out
    assert "commands:" not in out and PROMPT not in out  # refused before the banner


def test_a_conversation_that_outgrows_the_context(endless_ckpt, tmp_path):
    """The reply budget is trimmed to the room left (and says so); a conversation that fills the
    context is refused with what to do (/reset), and after /reset the chat goes on."""
    log = tmp_path / "turns.jsonl"
    system = "s" * 1950
    child = spawn("--model", str(endless_ckpt), "-m", "100", "--system-prompt", system, "--debug-token-log", str(log))
    try:
        child.expect_exact(PROMPT)
        child.sendline("hi")
        child.expect(r"\(reply limited to (\d+) tokens: the prompt \((\d+) tokens\) and the reply share the model's "
                     r"context of 2048 tokens; /reset starts a new conversation\)")
        room, prompt_tokens = int(child.match.group(1)), int(child.match.group(2))
        child.expect_exact(PROMPT, timeout=60)
        child.sendline("more")
        child.expect(r"\(the prompt \((\d+) tokens\) fills the model's context of 2048 tokens: "
                     r"/reset starts a new conversation\)")
        assert int(child.match.group(1)) > 2048
        child.expect_exact(PROMPT)
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(PROMPT)
        child.sendline("hi")
        child.expect_exact("(reply limited to")
        child.expect_exact(PROMPT, timeout=60)
        child.sendline("/exit")
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    t1, t2 = read_log(log)  # the refused turn ran nothing
    assert len(t1["prompt_ids"]) == prompt_tokens and room == 2048 - prompt_tokens < 100
    assert len(t1["completion_ids"]) == room and t1["finish_reason"] == "length"
    assert t2["prompt_ids"] == t1["prompt_ids"] and t2["turn"] == 2


def test_replies_show_control_characters_and_hide_special_tokens(tmp_path):
    noisy = write_noisy_checkpoint(tmp_path / "noisy")
    log = tmp_path / "turns.jsonl"
    child = spawn("--model", str(noisy), "--max-tokens", "16", "--debug-token-log", str(log))
    try:
        child.expect_exact(PROMPT)
        child.sendline("hi")
        child.expect_exact("hi\r\n")  # the terminal's echo of the line
        child.expect_exact(PROMPT)
        reply = child.before
        child.sendline("/exit")
        assert finish(child) == 0
    finally:
        child.terminate(force=True)
    (t1,) = read_log(log)
    bells, reserved = t1["completion_ids"].count(BEL), t1["completion_ids"].count(RESERVED)
    assert bells + reserved == 16 and bells > 0 and reserved > 0
    assert "\x07" not in reply and "reserved" not in reply
    assert reply.replace(DIM, "").replace(RESET, "").strip() == "\u2407" * bells
