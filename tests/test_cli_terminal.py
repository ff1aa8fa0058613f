"""`mtlqwen generate` and `convert` on a pseudo-terminal (pexpect): progress bars for loading, long
prompts and conversion (and none with --quiet), Ctrl-C stopping generate at the next engine step with
the summary of what was done and exit status 130. Tiny random checkpoints on CPU; bounded expects."""

from __future__ import annotations

import re
import sys
import time

import pexpect
import pytest

from frontend_fixtures import REPO, subprocess_env, write_tiny_chat_checkpoint


@pytest.fixture(scope="module")
def endless_ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("endless"), eos_reachable=False)


def spawn(*args: str) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "mtlqwen", *args], cwd=str(REPO), env=subprocess_env(),
                         timeout=90, encoding="utf-8", codec_errors="replace", dimensions=(40, 200))


def run_to_end(*args: str) -> tuple[str, int]:
    child = spawn(*args)
    try:
        child.expect(pexpect.EOF, timeout=120)
        child.close()
        return child.before, child.exitstatus
    finally:
        child.terminate(force=True)


LONG_PROMPT = "x" * 1800  # 1800 byte tokens, 15 engine steps of 128


def test_progress_for_loading_and_a_long_prompt(endless_ckpt):
    out, status = run_to_end("generate", "--model", str(endless_ckpt), "--ignore-chat-template", "-p", LONG_PROMPT,
                             "-m", "4")
    assert status == 0, out
    assert re.search(r"loading: +100%.*\| ([0-9.]+k)B/\1B .*B/s\]", out), out  # bytes read / total, rate
    # prompt processing: tokens done of the total, and a rate
    assert re.search(r"prompt: +\d+%.*\| \d+/1800 tok .*tok/s\]", out), out
    assert "Prompt: 1800 tokens" in out and "Generation: 4 tokens" in out

    quiet, status = run_to_end("generate", "--model", str(endless_ckpt), "--ignore-chat-template", "-p",
                               LONG_PROMPT, "-m", "4", "--quiet")
    assert status == 0, quiet
    assert "loading" not in quiet and "prompt:" not in quiet and "Generation: 4 tokens" in quiet


def test_convert_shows_progress(endless_ckpt, tmp_path):
    out, status = run_to_end("convert", str(endless_ckpt), str(tmp_path / "q4"), "-q", "4bit")
    assert status == 0, out
    assert re.search(r"loading: +\d+%", out) and re.search(r"writing: +100%", out), out
    assert f"wrote {tmp_path / 'q4'}" in out
    quiet, status = run_to_end("convert", str(endless_ckpt), str(tmp_path / "q8"), "-q", "8bit", "--quiet")
    assert status == 0 and "loading" not in quiet and "writing" not in quiet, quiet


def test_ctrl_c_stops_generate_with_a_summary(endless_ckpt):
    child = spawn("generate", "--model", str(endless_ckpt), "-p", "Tell me everything.", "-m", "2000")
    try:
        child.expect_exact("==========")
        child.expect(r"[\s\S]{20}", timeout=60)  # the completion is streaming
        t0 = time.monotonic()
        child.sendintr()
        child.expect(r"Generation: (\d+) tokens", timeout=30)
        stopped_after = time.monotonic() - t0
        generated = int(child.match.group(1))
        child.expect_exact("mtlqwen generate: interrupted (Ctrl-C)")
        child.expect(pexpect.EOF, timeout=30)
        child.close()
        assert child.exitstatus == 130
    finally:
        child.terminate(force=True)
    assert 0 < generated < 2000 - 17  # stopped well before the end (2000 at ~3 ms a token is seconds away)
    assert stopped_after < 5, stopped_after  # one engine step, not the rest of the completion


def test_ctrl_c_during_a_long_prompt():
    """Interrupted while the prompt is processed (the random built-in model with its byte tokenizer: 6000
    tokens take many seconds on the CPU): the summary says how much of the prompt was done."""
    child = spawn("generate", "--model", "random", "-p", "y" * 6000, "-m", "8")
    try:
        child.expect(r"prompt: +\d+%", timeout=90)  # the prompt bar is up: processing has begun
        child.sendintr()
        child.expect(r"Prompt: (\d+) of 6000 tokens", timeout=30)
        done = int(child.match.group(1))
        child.expect_exact("Generation: 0 tokens")
        child.expect(pexpect.EOF, timeout=30)
        child.close()
        assert child.exitstatus == 130
    finally:
        child.terminate(force=True)
    assert 0 < done < 6000 and done % 128 == 0  # whole engine steps of 128 tokens
