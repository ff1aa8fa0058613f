"""The `mtlqwen` command line: the README's first command, generate on a checkpoint, convert, errors
(one format, before any banner; flags that cannot apply), the context rule, what generate prints
(control characters made visible, special tokens hidden), --version and help for every flag."""

from __future__ import annotations

import argparse
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mtlqwen
from cli_fixtures import BEL, RESERVED, write_noisy_checkpoint
from frontend_fixtures import SPECIALS, subprocess_env, write_tiny_chat_checkpoint
from mtlqwen.cli import build_parser, main
from mtlqwen.runtime import Engine, SamplingParams

BANNER = "=" * 10
CONTEXT = 2048  # the tiny checkpoint's max_position_embeddings


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtlqwen", *args], input=stdin, capture_output=True,
                          text=True, timeout=180, env=subprocess_env())


def test_generate_random_model_says_it_is_random():
    r = run_cli("generate", "--model", "random", "--prompt", "Hello", "-m", "12")
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stderr
    assert "Generation: 12 tokens" in r.stdout and "Prompt: 5 tokens" in r.stdout
    assert "Peak memory:" in r.stdout


def test_generate_without_model_runs_the_demo_pair_speculating():
    from mtlqwen.demo import DemoPairMissing, pair_dir  # noqa: PLC0415

    try:
        pair_dir()
    except DemoPairMissing as e:
        pytest.skip(f"the package was built without the demo pair: {e}")
    r = run_cli("generate", "--prompt", "def fibonacci(n):", "-m", "24", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "built-in demo model" in r.stderr and "RANDOM" not in r.stderr
    assert "Speculative: " in r.stdout and " tokens per step" in r.stdout
    n = int(r.stdout.split("Generation: ")[1].split()[0])
    assert 1 <= n <= 24


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
    assert r.stderr == ""  # standard error is not a terminal: no progress bars


def test_convert_then_generate_same_greedy_tokens(ckpt, tmp_path):
    out = tmp_path / "q8"
    assert main(["convert", str(ckpt), str(out), "-q", "8bit"]) == 0
    ids = [5, 17, 99, 3, 250]
    a = np.asarray(mtlqwen.load(ckpt, quantize="8bit").logits(ids))
    b = np.asarray(mtlqwen.load(out).logits(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert (out / "tokenizer.json").is_file()  # the converted directory is usable on its own
    assert main(["convert", str(ckpt), str(out)]) == 1  # refuses to overwrite


LONG = "a" * 2030  # 2030 byte tokens without the template: 18 left of the 2048-token context


@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/no/such/dir"], "no checkpoint directory"),
    (["generate", "--quantize", "3bit", "--model", "{ckpt}"], "unsupported quantization"),
    (["generate", "--quantize", "3bit"], "--quantize needs a checkpoint --model"),
    (["generate", "--quantize", "4bit"], "--quantize needs a checkpoint --model"),
    (["chat", "--quantize", "8bit"], "--quantize needs a checkpoint --model"),
    (["generate", "--model", "{ckpt}", "--draft-bits", "8"], "--draft-bits needs a drafter"),
    (["chat", "--model", "{ckpt}", "--draft-bits", "4"], "--draft-bits needs a drafter"),
    (["generate", "--temp", "-1"], "--temp: temperature must be 0 (greedy) or in [0.01, inf), got -1.0"),
    (["chat", "--top-p", "0"], "--top-p: top_p must be in (0, 1], got 0.0"),
    (["generate", "-m", "0"], "--max-tokens: max_tokens must be >= 1, got 0"),
    (["generate", "--model", "{ckpt}", "--chat-template-args", "{bad"], "not valid JSON"),
    (["generate", "--model", "{ckpt}", "--ignore-chat-template", "--chat-template-args", "{bad"],
     "--chat-template-args does not apply with --ignore-chat-template"),
    (["generate", "--model", "{ckpt}", "--ignore-chat-template", "--system-prompt", "Be brief."],
     "--system-prompt does not apply with --ignore-chat-template"),
    (["generate", "--model", "random", "--system-prompt", "Be brief."], "--system-prompt does not apply: this tokenizer has no chat template"),
    (["generate", "--model", "{ckpt}", "-m", "3000"],
     "--max-tokens 3000 does not fit the model's context of 2048 tokens (the prompt and the reply share it): "
     "use --max-tokens 2047 or less"),
    (["generate", "--model", "{ckpt}", "--ignore-chat-template", "-p", "b" * 2048],
     "the prompt (2048 tokens) fills the model's context of 2048 tokens: shorten the prompt"),
    (["chat", "--debug-token-log", "/no/such/dir/log.jsonl"], "No such file or directory"),
    (["chat", "--prefix-interval", "-1"], "--prefix-interval must be >= 0"),
    (["chat", "--model", "{ckpt}", "--prefix-cache-bytes", "1KB"], "prefix_cache_bytes=1000 is less than one snapshot"),
    (["chat", "--model", "{ckpt}", "--top-k", "300"], "top_k must be <= the vocabulary size 272"),
    (["generate", "--model", "{ckpt}", "--top-k", "300"], "top_k must be <= the vocabulary size 272"),
])
def test_errors_are_one_line_before_any_banner(args, msg, ckpt):
    r = run_cli(*[a.replace("{ckpt}", str(ckpt)) for a in args])
    assert r.returncode == 1, (r.stdout, r.stderr)
    command = args[0]
    (error,) = r.stderr.splitlines()  # the error is the only line: no note, no progress
    assert error.startswith(f"mtlqwen {command}: error: ") and msg in error, r.stderr
    assert "Traceback" not in r.stderr
    assert BANNER not in r.stdout and "commands:" not in r.stdout  # nothing was started


def test_reply_budget_is_trimmed_to_the_context(tmp_path):
    endless = write_tiny_chat_checkpoint(tmp_path / "endless", eos_reachable=False)
    r = run_cli("generate", "--model", str(endless), "--ignore-chat-template", "-p", LONG, "-m", "100")
    assert r.returncode == 0, r.stderr
    assert ("mtlqwen generate: note: reply limited to 18 tokens: the prompt (2030 tokens) and the reply share "
            "the model's context of 2048 tokens") in r.stderr
    assert "Prompt: 2030 tokens" in r.stdout and "Generation: 18 tokens" in r.stdout


@pytest.fixture(scope="module")
def noisy_ckpt(tmp_path_factory):
    return write_noisy_checkpoint(tmp_path_factory.mktemp("noisy"))


def _completion(stdout: str) -> str:
    return stdout.split(BANNER + "\n", 1)[1].rsplit("\n" + BANNER, 1)[0]


def test_generate_escapes_control_characters_and_hides_special_tokens(noisy_ckpt):
    assert SPECIALS[RESERVED - 256] == "<|reserved_3|>"
    engine = Engine(mtlqwen.load(noisy_ckpt), slots=1)
    (out,) = engine.generate([list(b"Hi")], SamplingParams(max_tokens=16))
    bells, reserved = out.token_ids.count(BEL), out.token_ids.count(RESERVED)
    assert bells + reserved == 16 and bells > 0 and reserved > 0  # the fixture makes both kinds

    args = ("generate", "--model", str(noisy_ckpt), "--ignore-chat-template", "-p", "Hi", "-m", "16")
    r = subprocess.run([sys.executable, "-m", "mtlqwen", *args], capture_output=True, timeout=180,
                       env=subprocess_env())
    assert r.returncode == 0, r.stderr
    assert b"\x07" not in r.stdout  # the bell is shown as U+2407, never sent to the terminal
    assert _completion(r.stdout.decode()) == "\u2407" * bells

    shown = run_cli(*args, "--show-special-tokens")
    assert shown.returncode == 0, shown.stderr
    text = _completion(shown.stdout)
    assert text.count("<|reserved_3|>") == reserved and text.count("\u2407") == bells
    assert len(text) == bells + reserved * len("<|reserved_3|>")


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"mtlqwen {mtlqwen.__version__} (mlx {mx.__version__})"


def test_every_flag_has_help():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {a.dest}" for name, p in sub.choices.items() for a in p._actions
               if not a.help and not isinstance(a, argparse._HelpAction)]
    assert sorted(sub.choices) == ["benchmark", "cache-prompt", "chat", "convert", "generate", "run-batch", "serve"]
    assert missing == []
    assert all(a.help for a in parser._actions)


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("generate", "cache-prompt", "benchmark", "convert", "chat", "serve", "run-batch"):
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


def test_no_frontend_imports_the_cli_module():
    """cli.py assembles the parser from the front-ends; they share flags through frontends/args.py."""
    import ast  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    frontends = pathlib.Path(mtlqwen.__file__).parent / "frontends"
    package = ["mtlqwen", "frontends"]
    imported = {}
    for f in sorted(frontends.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):  # resolve relative imports against mtlqwen.frontends
                base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
                module = ".".join(p for p in (base, node.module or "") if p)
                names |= {module} | {f"{module}.{a.name}" for a in node.names}
        imported[f.name] = names
    assert "mtlqwen.frontends.args.add_model_args" in imported["chat.py"]  # the resolution works
    assert [name for name, names in imported.items() if "mtlqwen.cli" in names] == []


def test_load_reports_progress_in_bytes(ckpt, monkeypatch):
    """load(progress=) reports (done, total) bytes after each chunk of tensors; the weights are those of
    a load without it."""
    from mtlqwen.model import loading  # noqa: PLC0415

    monkeypatch.setattr(loading, "EVAL_CHUNK_BYTES", 64 * 1024)  # the tiny checkpoint is ~0.9 MB: many chunks
    calls = []
    model = mtlqwen.load(ckpt, progress=lambda done, total: calls.append((done, total)))
    total = sum(v.nbytes for v in model.weights.values())
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) > 5
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted({d for d, _ in calls})
    plain = mtlqwen.load(ckpt)
    assert sorted(plain.weights) == sorted(model.weights)
    assert all(np.array_equal(np.asarray(plain.weights[k]), np.asarray(model.weights[k])) for k in plain.weights)


def test_first_ctrl_c_is_a_flag_the_second_interrupts():
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from mtlqwen.frontends.terminal import Interrupt  # noqa: PLC0415

    before = signal.getsignal(signal.SIGINT)
    with Interrupt() as intr:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before kill() returns to Python code
        assert intr.hit
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back


def test_sampling_defaults_demo_samples_unless_told():
    """No --model (the demo pair): temperature 0.7, top-p 0.95; a checkpoint: greedy, top-p off; a flag given
    always wins."""
    from types import SimpleNamespace  # noqa: PLC0415

    from mtlqwen.frontends.args import sampling_defaults  # noqa: PLC0415

    ns = lambda **kw: SimpleNamespace(**{"model": None, "temp": None, "top_p": None, **kw})  # noqa: E731
    assert sampling_defaults(ns()) == (0.7, 0.95)
    assert sampling_defaults(ns(model="./ckpt")) == (0.0, 1.0)
    assert sampling_defaults(ns(model="random")) == (0.0, 1.0)
    assert sampling_defaults(ns(temp=0.0)) == (0.0, 0.95)
    assert sampling_defaults(ns(model="./ckpt", temp=0.3, top_p=0.5)) == (0.3, 0.5)


def test_benchmark_reports_each_trial_and_their_average():
    r = run_cli("benchmark", "--model", "random", "-p", "24", "-g", "6", "-b", "3", "-n", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Running warmup: 3 x 24 prompt tokens, 6 generated each"
    rows = [dict(kv.split("=") for kv in line.split(": ", 1)[1].split(", ")) for line in lines[1:]]
    assert [line.split(":")[0] for line in lines[1:]] == ["Trial 1", "Trial 2", "Averages"]
    for key in ("prompt_tps", "generation_tps", "peak_memory"):
        got = [float(row[key]) for row in rows]
        assert all(v > 0 for v in got) and abs(got[2] - (got[0] + got[1]) / 2) <= 1e-3 + 1e-6 * got[2], (key, got)


def test_benchmark_counts_the_tokens_after_each_first(ckpt):
    from mtlqwen.frontends.benchmark import trial  # noqa: PLC0415

    eng = Engine(mtlqwen.load(ckpt), slots=3, block_tokens=16, num_blocks=24)
    prompts = [[5 + i] * (10 + i) for i in range(3)]
    r = trial(eng, prompts, 7)
    assert r["generation_tokens"] == 3 * (7 - 1)  # each request's first token is timed with the prompts
    assert eng.stats()["running"] == 0 and not eng.has_work()


@pytest.mark.parametrize("args, msg", [
    (["-p", "0"], "--prompt-tokens must be at least 1, got 0"),
    (["-n", "0"], "--num-trials must be at least 1, got 0"),
    (["-p", "8190", "-g", "16"], "do not fit the model's context of 8192 tokens"),
])
def test_benchmark_refuses_what_cannot_run(args, msg):
    r = run_cli("benchmark", "--model", "random", *args)
    assert r.returncode == 1 and msg in r.stderr, r.stderr


def test_sizes_for_the_prefix_cache_budget():
    from mtlqwen.frontends.args import parse_bytes  # noqa: PLC0415
    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    assert [parse_bytes(t) for t in ("1073741824", "512MB", "4GiB", "1.5G", "64kib")] == [
        2**30, 512 * 10**6, 4 * 2**30, 1_500_000_000, 2**16]
    for bad in ("4XB", "-1", "", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_bytes(bad)
    args = build_parser().parse_args(["serve", "--prefix-cache-bytes", "4GiB"])
    assert _engine_kwargs(args)["prefix_cache_bytes"] == 4 * 2**30
    assert "prefix_cache_bytes" not in _engine_kwargs(build_parser().parse_args(["serve"]))
    r = run_cli("serve", "--prefix-cache-bytes", "lots")
    assert r.returncode == 2 and "argument --prefix-cache-bytes: not a size: 'lots'" in r.stderr


def test_a_drafter_from_the_command_line_speculates_and_changes_nothing(ckpt, tmp_path):
    """--draft (mlx-lm's --draft-model too) and --num-draft-tokens reach the engine: generate speculates, and its
    greedy text is the plain run's."""
    from dflash_checkpoints import write_tiny_drafter  # noqa: PLC0415

    draft = write_tiny_drafter(tmp_path / "drafter", ckpt, num_layers=2, block_size=8, mask_token_id=270)
    plain = run_cli("generate", "--model", str(ckpt), "-p", "Hi there", "-m", "12")
    spec = run_cli("generate", "--model", str(ckpt), "--draft-model", str(draft), "--num-draft-tokens", "3",
                   "-p", "Hi there", "-m", "12")
    assert plain.returncode == spec.returncode == 0, plain.stderr + spec.stderr
    assert "Speculative: " in spec.stdout and "Speculative" not in plain.stdout
    assert spec.stdout.split(BANNER)[1] == plain.stdout.split(BANNER)[1]
    too_many = run_cli("generate", "--model", str(ckpt), "--draft", str(draft), "--num-draft-tokens", "8", "-p", "x")
    assert too_many.returncode == 1 and "n_draft must be an int in 1..7" in too_many.stderr, too_many.stderr
    for cmd in ("generate", "chat", "benchmark", "cache-prompt"):
        r = run_cli(cmd, "--model", str(ckpt), "--num-draft-tokens", "3", *(["--prompt-cache-file", "x"]
                                                                            if cmd == "cache-prompt" else []))
        assert r.returncode == 1 and "--num-draft-tokens needs a drafter" in r.stderr, (cmd, r.stderr)
    args = build_parser().parse_args(["serve", "--draft-model", "d", "--num-draft-tokens", "4"])
    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    assert {k: _engine_kwargs(args)[k] for k in ("draft", "n_draft")} == {"draft": "d", "n_draft": 4}


def test_serve_takes_the_built_in_models_and_refuses_missing_paths(tmp_path):
    from mtlqwen.frontends.server import _check_model_arg  # noqa: PLC0415

    _check_model_arg(None)
    _check_model_arg("random")  # the random-weight built-in, as --help says
    _check_model_arg("org/repo")  # a repo id: fetched while loading
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        _check_model_arg(str(tmp_path / "missing"))
