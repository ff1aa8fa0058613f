"""The start-up warm-up (runtime/warmup.py): when it runs, the workload it sends (requests, prompt
lengths, how many tokens each), that its kernels' first-use checks are counted and left behind for the
serving engine, that it leaves nothing in the model the serving engine would see, and the CLI flag."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mlx.core as mx
from mtlqwen.kernels import dispatch
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, warmup

from dflash_checkpoints import write_tiny_drafter
from engine_checks import greedy
from frontend_fixtures import REPO, subprocess_env
from hf_checkpoints import random_token_ids, write_tiny_checkpoint

ENGINE_KW = {"slots": 3, "step_tokens": 16, "prefill_step_tokens": 32, "block_tokens": 16, "prefix_interval": 16}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("warmup") / "m", r=2, seed=5)


def test_when_it_runs(monkeypatch):
    assert warmup.should_warm_up("on") and not warmup.should_warm_up("off")
    assert not warmup.should_warm_up("on", group=object())  # tensor parallel: never (rank 0 alone)
    monkeypatch.setattr(warmup, "use_kernels", lambda: False)
    assert not warmup.should_warm_up("auto")
    monkeypatch.setattr(warmup, "use_kernels", lambda: True)
    assert warmup.should_warm_up("auto")
    with pytest.raises(ValueError, match="auto, on, off"):
        warmup.should_warm_up("yes")


def test_the_workload_and_its_pool(ckpt, monkeypatch):
    """6 prefill requests of 1 token, one at a time (4 row classes, one prefill-only step + 3, that prompt
    extended by 5: a prefix-cache hit), then one request per slot together, stopping after 2, 3, 4 tokens,
    on a throwaway engine with the same prefix cache and a pool for the workload."""
    import mtlqwen  # noqa: PLC0415

    model = mtlqwen.load(ckpt)
    seen, engines = [], []
    real_generate = Engine.generate

    def spy(self, prompts, sampling=None, progress=False):
        engines.append(self)
        outs = real_generate(self, prompts, sampling, progress)
        seen.append([(len(p), s.max_tokens, len(o.token_ids), o.finish_reason, o.cached_tokens)
                     for p, s, o in zip(prompts, sampling, outs)])
        return outs

    monkeypatch.setattr(Engine, "generate", spy)
    out = warmup.warm_up(model, ENGINE_KW)
    assert seen == [[(5, 1, 1, "length", 0)], [(20, 1, 1, "length", 0)], [(40, 1, 1, "length", 0)],
                    [(128, 1, 1, "length", 0)], [(35, 1, 1, "length", 0)],
                    [(40, 1, 1, "length", 35)],  # restored from the 35-token request's turn entry
                    [(6, 2, 2, "length", 0), (7, 3, 3, "length", 0), (8, 4, 4, "length", 0)]]
    eng = engines[0]
    assert engines == [eng] * 7 and eng.prefix is not None and eng.slots == 3 and eng.step_tokens == 16
    per_seq = -(-(32 + 8 + 3 + 2) // 16) + 1  # the longest prompt plus its tokens, in blocks, plus one
    assert eng.num_blocks == 4 * per_seq + 1 == 17  # the slots' and the prefix entries' share
    eng.clear_prefix_cache()
    assert eng.pool.num_free == eng.num_blocks  # everything returned
    assert out["requests"] == 9 and out["instantiations"] == 0 and out["seconds"] >= 0  # the CPU builds none


def test_first_use_checks_are_left_for_the_serving_engine(ckpt):
    """A (fake) kernel's first use happens in the warm-up: counted there, already checked afterwards."""
    import mtlqwen  # noqa: PLC0415

    model = mtlqwen.load(ckpt)
    op = dispatch.OPS["rms_norm"]
    calls = []

    def kern(*a, **kw):
        calls.append(1)
        return op.reference(*a, **kw)

    with dispatch.inject("rms_norm", kern):
        out = warmup.warm_up(model, ENGINE_KW, log=lambda m: calls.append(m))
        assert out["instantiations"] == 1 and kern in op.checked
        assert calls[-1].startswith("warm-up: 9 requests, 1 kernel instantiations built in ")


def test_the_serving_engine_sees_the_same_model(ckpt, tmp_path):
    """Greedy outputs after a warm-up (with a drafter: its speculation too) equal a fresh engine's."""
    import mtlqwen  # noqa: PLC0415

    model = mtlqwen.load(ckpt)
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", ckpt, num_layers=1, block_size=4), model)
    prompts = [random_token_ids(n, 512, seed=n) for n in (9, 30)]
    before = Engine(model, **ENGINE_KW).generate(prompts, greedy(10, ignore_eos=True))
    weights = {k: np.array(v) for k, v in model.weights.items() if isinstance(v, mx.array)}
    out = warmup.warm_up(model, {**ENGINE_KW, "draft": drafter})
    assert out["requests"] == 9
    assert all(np.array_equal(np.array(model.weights[k]), w) for k, w in weights.items())
    after = Engine(model, **ENGINE_KW).generate(prompts, greedy(10, ignore_eos=True))
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_cli_flag():
    for cmd in ("serve", "chat"):
        r = subprocess.run([sys.executable, "-m", "mtlqwen", cmd, "--help"], cwd=str(REPO), env=subprocess_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "--warmup {auto,on,off}" in r.stdout, r.stdout[-500:]
    r = subprocess.run([sys.executable, "-m", "mtlqwen", "serve", "--warmup", "sometimes"], cwd=str(REPO),
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'sometimes'" in r.stderr
