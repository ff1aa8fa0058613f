"""examples/batched_generation.py: its progress moves from the first engine step (not when the first
request finishes), and with --chat it prints the prompts as text, not token ids."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import mtlqwen
from frontend_fixtures import REPO, subprocess_env, write_tiny_chat_checkpoint
from mtlqwen.runtime import Engine, SamplingParams

EXAMPLE = REPO / "examples" / "batched_generation.py"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("example"), eos_reachable=False)


def load_example():
    spec = importlib.util.spec_from_file_location("batched_generation", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RecordingBar:
    """Stands in for tqdm: records (position, postfix) at each update."""

    def __init__(self, total, **_):
        self.total, self.n, self.postfix, self.seen = total, 0, "", []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, k):
        self.n += k
        self.seen.append(self.n)

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s
        self.seen[-1] = (self.seen[-1], s)


def test_progress_moves_at_the_first_step(ckpt, monkeypatch):
    mod = load_example()
    bars = []
    monkeypatch.setattr(mod, "tqdm", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    engine = Engine(mtlqwen.load(ckpt), slots=2, step_tokens=16)
    prompts = [[5 + i] * 20 for i in range(4)]  # 80 prompt tokens over 2 slots
    sampling = [SamplingParams(max_tokens=6) for _ in prompts]
    outputs = mod.run(engine, prompts, sampling)
    (bar,) = bars
    assert bar.total == 80 + 4 * 6
    # the first step prefills both admitted prompts whole (nobody decodes yet: the prefill budget, not
    # step_tokens), before any request is done
    assert bar.seen[0] == (40, "0/4 done")
    assert bar.seen[-1] == (80 + 4 * 6, "4/4 done")
    assert [len(o.token_ids) for o in outputs] == [6] * 4
    assert [o.token_ids for o in outputs] == [o.token_ids for o in Engine(mtlqwen.load(ckpt), slots=4).generate(
        prompts, SamplingParams(max_tokens=6))]  # same greedy tokens as generate()


def test_chat_prompts_are_printed_as_text(ckpt):
    r = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(ckpt), "--num-prompts", "3", "-m", "4", "--chat"],
                       capture_output=True, text=True, timeout=180, env=subprocess_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    shown = [ln for ln in r.stdout.splitlines() if ln.startswith("--- ")]
    assert len(shown) == 3
    for line in shown:
        assert line.startswith("--- 'Write a short note about ") and line.endswith(".' (chat template applied)")
    assert "Requests: 3 done, 0 failed" in r.stdout
