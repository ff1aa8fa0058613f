"""The `mtlqwen` command line: the README's first command, generate on a checkpoint, convert, errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mtlqwen
from frontend_fixtures import subprocess_env, write_tiny_chat_checkpoint
from mtlqwen.cli import main


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtlqwen", *args], input=stdin, capture_output=True,
                          text=True, timeout=180, env=subprocess_env())


def test_generate_without_model_says_it_is_random():
    r = run_cli("generate", "--prompt", "Hello", "-m", "12")
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stderr
    assert "Generation: 12 tokens" in r.stdout and "Prompt: 5 tokens" in r.stdout
    assert "Peak memory:" in r.stdout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("cli"), eos_reachable=False)


def test_generate_on_a_checkpoint_applies_the_chat_template(ckpt):
    r = run_cli("generate", "--model", str(ckpt), "--prompt", "-", "-m", "8", stdin="Hi there")
    assert r.returncode == 0, r.stderr
    plain = run_cli("generate", "--model", str(ckpt), "--prompt", "Hi there", "-m", "8", "--ignore-chat-template")
    prompt_tokens = lambda out: int(out.split("Prompt: ")[1].split()[0])  # noqa: E731
    # the template wraps the message in role markers, so the templated prompt is longer
    assert prompt_tokens(r.stdout) > prompt_tokens(plain.stdout) == len("Hi there")


def test_convert_then_generate_same_greedy_tokens(ckpt, tmp_path):
    out = tmp_path / "q8"
    assert main(["convert", str(ckpt), str(out), "-q", "8bit"]) == 0
    ids = [5, 17, 99, 3, 250]
    a = np.asarray(mtlqwen.load(ckpt, quantize="8bit").logits(ids))
    b = np.asarray(mtlqwen.load(out).logits(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert (out / "tokenizer.json").is_file()  # the converted directory is usable on its own
    assert main(["convert", str(ckpt), str(out)]) == 1  # refuses to overwrite


@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/no/such/dir"], "no checkpoint directory"),
    (["generate", "--quantize", "3bit", "--model", "{ckpt}"], "unsupported quantization"),
    (["generate", "--temp", "-1"], "temperature"),
    (["generate", "--model", "{ckpt}", "--chat-template-args", "{bad"], "not valid JSON"),
])
def test_errors_are_one_line(args, msg, ckpt):
    r = run_cli(*[a.replace("{ckpt}", str(ckpt)) for a in args])
    assert r.returncode == 1
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("generate", "convert", "chat", "serve"):
        assert cmd in r.stdout


def test_repo_id_goes_through_snapshot_download(monkeypatch, ckpt):
    """A name that is not a local directory is a Hugging Face repo id: only the needed files are fetched."""
    import huggingface_hub  # noqa: PLC0415

    seen = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        seen["repo"], seen["patterns"] = repo_id, allow_patterns
        return str(ckpt)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model = mtlqwen.load("someone/tiny-qwen35")
    assert seen["repo"] == "someone/tiny-qwen35"
    assert "model*.safetensors" in seen["patterns"] and "*.json" in seen["patterns"]
    assert model.config.vocab_size > 0

    def failing(repo_id, **kw):
        raise OSError("404 Client Error: Repository Not Found")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(FileNotFoundError, match="someone/missing.*Repository Not Found"):
        mtlqwen.load("someone/missing")
