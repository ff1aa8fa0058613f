"""Tensor parallelism (model/sharding.py, model/distributed.py).

Two kinds of test: single-process simulated ranks (shard the weights, run every rank's blocks on the same
input, sum the partial outputs, compare with the whole model), and real runs of 2 ranks over the ring
back-end on 127.0.0.1 (`mlx.launch -n 2 --backend ring`, tests/tp_worker.py) whose outputs must equal the
single-process engine's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import hf_checkpoints as H
from frontend_fixtures import free_port
import mtlqwen
from dflash_checkpoints import write_tiny_drafter
from mtlqwen import Qwen35Model, SeqLayout
from mtlqwen.kernels import linear
from mtlqwen.model import QuantSpec
from mtlqwen.model.builtin import demo_config, random_weights
from mtlqwen.model.sharding import (
    Shard, ShardError, _vocab_rows, check_split, padded_vocab, shard_config, shard_weights, vocab_range,
)

WORKER = Path(__file__).with_name("tp_worker.py")
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    dense = H.write_tiny_checkpoint(root / "dense", moe=False, r=2, num_layers=4, seed=41)
    return {
        "dense": dense,
        "moe": H.write_tiny_checkpoint(root / "moe", moe=True, r=2, num_layers=4, seed=42),
        "other": H.write_tiny_checkpoint(root / "other", moe=False, r=2, num_layers=4, seed=43),
        "tied": H.write_tiny_checkpoint(root / "tied", moe=False, tied=True, r=2, num_layers=4, seed=44),
        "draft": write_tiny_drafter(root / "draft", dense, num_layers=2, block_size=16),
    }


# ---- simulated ranks, one process

def _ranks(model: Qwen35Model, n: int) -> list[Qwen35Model]:
    c = model.config
    return [Qwen35Model(shard_config(c, n), shard_weights(model.weights, c, Shard(r, n))) for r in range(n)]


def _check_blocks(model: Qwen35Model, n: int, tol: float) -> None:
    """Every layer: mixer + out_proj and MLP/MoE, whole vs sum over ranks, for a prefill then a decode
    step (the decode reads the KV / GDN state each rank wrote); each rank's state is its slice of the whole."""
    ranks = _ranks(model, n)
    H_ = model.config.hidden_size
    caches = [m.make_cache(2, 1, 16) for m in [model, *ranks]]
    for step, (T, kv) in enumerate([(6, 0), (1, 6)]):
        x = mx.random.normal((T, H_), key=mx.random.key(step))
        lay = SeqLayout([0, T], [kv], [[0]], [0], 16)
        for i, layer in enumerate(model.layers):
            whole = linear(layer.mixer(x, lay, caches[0]), layer.mixer.out_proj)
            parts = [linear(r.layers[i].mixer(x, lay, cr), r.layers[i].mixer.out_proj)
                     for r, cr in zip(ranks, caches[1:])]
            np.testing.assert_allclose(np.array(sum(parts)), np.array(whole), atol=tol, rtol=tol)
            np.testing.assert_allclose(np.array(sum(r.layers[i].mlp(x) for r in ranks)), np.array(layer.mlp(x)),
                                       atol=tol, rtol=tol)
    c = model.config
    Hv = c.linear_num_value_heads
    for j, rec in enumerate(caches[0].rec_states):  # [slots, Hv, dv, dk]: rank r holds its value heads
        got = mx.concatenate([cr.rec_states[j] for cr in caches[1:]], axis=1)
        assert got.shape == rec.shape and Hv % n == 0
        np.testing.assert_allclose(np.array(got), np.array(rec), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_simulated_ranks_match_whole_blocks(ckpts, kind):
    _check_blocks(mtlqwen.load(ckpts[kind]), 2, 2e-5)


def test_simulated_ranks_quantized(ckpts):
    """4-bit g32: row splits of packed tensors and column splits on group boundaries give exact partials."""
    _check_blocks(mtlqwen.load(ckpts["dense"], quantize="4bit-g32"), 2, 2e-5)


def test_replicated_kv_heads_four_ranks():
    """2 KV heads over 4 ranks: each KV head is kept by the 2 ranks whose query heads read it."""
    c = dataclasses.replace(demo_config(), num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                            linear_num_key_heads=4, linear_num_value_heads=8)
    model = Qwen35Model(c, random_weights(c, seed=3, dtype=mx.float32))
    assert shard_config(c, 4).num_key_value_heads == 1
    _check_blocks(model, 4, 3e-5)
    kw = f"model.layers.{c.full_attention_layers[0]}.self_attn.k_proj.weight"
    per_rank = [shard_weights({kw: model.weights[kw]}, c, Shard(r, 4))[kw] for r in range(4)]
    assert mx.array_equal(per_rank[0], per_rank[1]) and mx.array_equal(per_rank[2], per_rank[3])
    assert mx.array_equal(per_rank[0], model.weights[kw][: c.head_dim])


@pytest.mark.parametrize("moe, quant", [(False, None), (False, QuantSpec(4, 32)), (True, QuantSpec(4, 32))])
def test_random_weights_built_per_rank_equal_the_whole_models_shards(moe, quant):
    """random_weights(shard=...) cuts each tensor as it is made (a model larger than one device): each rank
    gets exactly the tensors shard_weights cuts from the whole model, with the same quantization config."""
    c = dataclasses.replace(demo_config(), num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                            linear_num_key_heads=4, linear_num_value_heads=8)
    if moe:
        c = dataclasses.replace(c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=64)
    assert c.is_moe == moe
    whole_c = dataclasses.replace(c)
    whole = random_weights(whole_c, seed=5, quantize=quant)
    for r in range(2):
        rank_c = dataclasses.replace(c)
        mine = random_weights(rank_c, seed=5, quantize=quant, shard=Shard(r, 2))
        ref = shard_weights(whole, whole_c, Shard(r, 2))
        assert sorted(mine) == sorted(ref)
        assert [k for k in ref if not mx.array_equal(mine[k], ref[k])] == []
        assert (rank_c.quantization, rank_c.quant_overrides) == (whole_c.quantization, whole_c.quant_overrides)
    if quant is not None and moe:
        assert whole_c.quant_overrides  # the router kept at 8 bits: an override the ranks must agree on


def test_vocab_shards_pad_and_cover():
    t = mx.arange(10 * 3, dtype=mx.float32).reshape(10, 3)
    rows = [_vocab_rows(t, 10, Shard(r, 4)) for r in range(4)]  # 10 -> 12 rows, 3 per rank
    assert padded_vocab(10, 4) == 12 and [vocab_range(10, Shard(r, 4)) for r in range(4)][-1] == (9, 12)
    assert all(x.shape == (3, 3) for x in rows)
    full = mx.concatenate(rows)
    assert mx.array_equal(full[:10], t) and mx.array_equal(full[10:], mx.zeros((2, 3)))


def test_impossible_splits_are_refused(ckpts):
    c = mtlqwen.load(ckpts["dense"]).config
    with pytest.raises(ShardError, match=r"num_attention_heads=4 is not divisible by 3"):
        check_split(c, 3)
    with pytest.raises(ShardError, match="linear_num_key_heads=2 is not divisible by 4"):
        check_split(c, 4)
    moe = mtlqwen.load(ckpts["moe"], quantize="4bit-g32")  # expert down_proj: 32 columns, 16 per rank
    with pytest.raises(ShardError, match=r"switch_mlp.down_proj: the column split .* 32-column groups"):
        shard_weights(moe.weights, moe.config, Shard(0, 2))


def test_tensor_parallel_flag_alone_is_an_error():
    """A process not started by a launcher has no group: the --tensor-parallel error says how to launch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    code = ("from mtlqwen.model.distributed import tensor_parallel_group\n"
            "try:\n    tensor_parallel_group()\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("ShardError --tensor-parallel: no distributed group") and "mlx.launch" in out


def test_tensor_parallel_group_of_one_is_an_error(monkeypatch):
    """A launcher that starts a single rank (e.g. mpirun -n 1) gives a group of size 1: refused."""
    from mtlqwen.model import distributed  # noqa: PLC0415

    single = mx.distributed.init()  # not strict: the singleton group
    assert single.size() == 1
    monkeypatch.setattr(distributed.mx.distributed, "init", lambda strict=False, backend="any": single)
    with pytest.raises(ShardError, match="needs at least 2 ranks, but this group has 1"):
        distributed.tensor_parallel_group()


# ---- 2 ranks over the ring back-end

def _run_ring(cmd_after_port: list[str], **kw) -> subprocess.CompletedProcess:
    """mlx.launch -n 2 over the ring on 127.0.0.1; a launch whose rank lost its port to another process in the
    meantime is retried on a fresh pair (at most three tries), so a busy machine does not fail the test."""
    launcher = shutil.which("mlx.launch")
    assert launcher, "mlx.launch (installed with mlx) is not on PATH"
    for _ in range(3):
        cmd = [launcher, "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1", "-p", str(free_port(pair=True)),
               *cmd_after_port]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, **kw)
        if "Couldn't bind socket" not in p.stdout + p.stderr:
            return p
    return p


def _launch(args: list[str], tmp_path: Path, tag: str) -> subprocess.CompletedProcess:
    return _run_ring([sys.executable, str(WORKER), *args, str(tmp_path / tag)], cwd=tmp_path)


def _single(ckpt: Path, tmp_path: Path, extra=()) -> dict:
    subprocess.run([sys.executable, str(WORKER), str(ckpt), *extra, str(tmp_path / "single"), "--single"],
                   check=True, timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    return json.loads((tmp_path / "single.rank0.json").read_text())


def _two_ranks(ckpt: Path, tmp_path: Path, extra=()) -> list[dict]:
    p = _launch([str(ckpt), *extra], tmp_path, "tp")
    missing = [r for r in range(2) if not (tmp_path / f"tp.rank{r}.json").is_file()]  # mlx.launch exits 0 anyway
    assert p.returncode == 0 and not missing, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((tmp_path / f"tp.rank{r}.json").read_text()) for r in range(2)]


TWO_RANK_RUNS = {"dense": [], "moe": [], "tied": [], "draft": ["--draft"], "4bit": ["--quantize", "4bit-g32"],
                 "compiled": ["--compile"], "draft-compiled": ["--draft", "--compile"]}


@pytest.mark.parametrize("kind", list(TWO_RANK_RUNS))
def test_two_ranks_equal_single_process(ckpts, tmp_path, kind):
    """Batched greedy + one seeded sampled request, then a wave of prefix hits: both ranks produce the
    single-process engine's tokens and cache hits, each holding about half the weights and half the pools.
    Also with tied embeddings, a (replicated) drafter, 4-bit weights, decode steps through mx.compile, and the
    drafter with compiled steps (which pipelines its all-verify steps by default)."""
    ckpt = ckpts[kind if kind in ("moe", "tied") else "dense"]  # tied: one vocab shard is embedding and head
    extra = [a if a != "--draft" else f"--draft={ckpts['draft']}" for a in TWO_RANK_RUNS[kind]]
    ref = _single(ckpt, tmp_path, extra)
    ranks = _two_ranks(ckpt, tmp_path, extra)
    assert [o["cached_tokens"] for o in ref["outputs"]] == [0, 0, 0, 32, 16, 32]
    assert all(len(o["tokens"]) == 12 for o in ref["outputs"])
    for rep in ranks:
        assert rep["size"] == 2
        assert rep["outputs"] == ref["outputs"]
        assert rep["prefix_hits"] == ref["prefix_hits"] == 3
        assert rep.get("pipelined") == ref.get("pipelined")  # the same tokens, and pipelined steps in step
    if kind == "draft-compiled":
        assert ref["pipelined"]["spec_pipelined_steps"] > 0
        assert 0.49 < rep["weight_bytes"] / ref["weight_bytes"] < 0.51  # replicated: norms, router only
        assert rep["cache_bytes"] * 2 == ref["cache_bytes"]


def test_ranks_with_different_checkpoints_are_refused(ckpts, tmp_path):
    """Both ranks stop with the error before loading any tensor (mlx.launch itself exits 0 when a rank fails,
    so the test reads the ranks' output and checks that no rank wrote a report)."""
    p = _launch([str(ckpts["dense"]), "--rank1-checkpoint", str(ckpts["other"])], tmp_path, "bad")
    out = p.stdout + p.stderr
    assert out.count("ShardError: ranks [1] load a different checkpoint than rank 0") == 2, out[-3000:]
    assert not list(tmp_path.glob("bad.rank*.json"))


# ---- the command-line front-ends behind rank 0 (`--model random`: no checkpoint needed)

def _launch_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return _run_ring(["--", sys.executable, "-m", "mtlqwen", *args, "--tensor-parallel"], **kw)


def test_generate_two_ranks_prints_once_and_matches(tmp_path):
    args = ["generate", "--model", "random", "--prompt", "Hello there", "-m", "12", "--quiet"]
    ref = subprocess.run([sys.executable, "-m", "mtlqwen", *args], capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    p = _launch_cli(args, cwd=tmp_path)
    assert p.stdout.count("==========") == 2, p.stdout + p.stderr  # rank 1 prints nothing
    completion = lambda out: out.split("==========")[1]  # noqa: E731
    assert completion(p.stdout) == completion(ref.stdout)
    assert "Generation: 12 tokens" in p.stdout


def _stop(proc: subprocess.Popen, log) -> None:
    """Interrupt the launcher's process group (the launcher does not forward it), then kill what is left."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass  # every process of the group has exited
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    log.close()


def _serve_two_ranks(tmp_path: Path):
    """(process, base URL, log) of `serve --tensor-parallel` on 2 ranks once /health answers. A start that lost
    the HTTP or a ring port to another process in the meantime is retried on fresh ports (three tries)."""
    import urllib.request  # noqa: PLC0415

    launcher = shutil.which("mlx.launch")
    assert launcher, "mlx.launch (installed with mlx) is not on PATH"
    for _ in range(3):
        ring = free_port(pair=True)
        port = next(q for q in iter(free_port, None) if q not in (ring - 1, ring, ring + 1))
        cmd = [launcher, "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1", "-p", str(ring), "--",
               sys.executable, "-m", "mtlqwen", "serve", "--port", str(port), "--slots", "2", "--tensor-parallel"]
        log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
        # its own process group, so that _stop reaches the launcher and both ranks
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if json.load(urllib.request.urlopen(f"{base}/health", timeout=5))["status"] == "ok":
                    return proc, base, log
            except OSError:
                pass
            time.sleep(0.5)
        _stop(proc, log)
        text = (tmp_path / "serve.log").read_text()
        if "Couldn't bind socket" not in text and "already in use" not in text:
            raise AssertionError(text[-3000:])
    raise AssertionError(text[-3000:])


def test_serve_two_ranks_answers_from_rank0(tmp_path):
    """serve --tensor-parallel: rank 0 binds and answers; its reply is the single-process engine's."""
    import urllib.request  # noqa: PLC0415

    from mtlqwen import Engine, SamplingParams  # noqa: PLC0415
    from mtlqwen.demo import load_builtin  # noqa: PLC0415

    proc, base, log = _serve_two_ranks(tmp_path)
    try:
        body = json.dumps({"prompt": "Hello there", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
        reply = json.load(urllib.request.urlopen(req, timeout=120))
    finally:
        _stop(proc, log)
    b = load_builtin(None)  # what serve runs without --model (the demo pair when shipped, else random weights)
    ref = Engine(b.model, tokenizer=b.tokenizer, slots=1, draft=b.drafter).generate(
        "Hello there", SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert reply["choices"][0]["text"] == ref.text
    assert reply["usage"]["completion_tokens"] == 8
    assert (tmp_path / "serve.log").read_text().count("listening on") == 1  # rank 0 alone serves


def test_memory_sizing_counts_one_shard(ckpts):
    """The pool sizing reads the rank's config: the same KV budget buys twice the bundles on 2 ranks, and
    a rank's pools are half the whole model's."""
    from mtlqwen import Engine  # noqa: PLC0415
    from mtlqwen.model.cache import ModelCache  # noqa: PLC0415

    model = mtlqwen.load(ckpts["dense"])
    rank0 = _ranks(model, 2)[0]
    budget = 40 * ModelCache.bytes_per_block(model.config, 8, model.dtype)
    whole = Engine(model, slots=2, block_tokens=8, kv_bytes=budget, prefix_interval=0)
    shard = Engine(rank0, slots=2, block_tokens=8, kv_bytes=budget, prefix_interval=0)
    assert (whole.num_blocks, shard.num_blocks) == (40, 80)
    assert ModelCache.bytes_per_slot(rank0.config, model.dtype) * 2 == ModelCache.bytes_per_slot(model.config, model.dtype)


def test_chat_two_ranks_replies_once_and_matches(tmp_path):
    """chat --tensor-parallel: the launcher hands every rank the input lines; rank 0 reads them and drives
    the engines. (The launcher never passes end-of-input on, so the session ends with /exit.)"""
    feed = "Hello there\n/exit\n"
    ref = subprocess.run([sys.executable, "-m", "mtlqwen", "chat", "--model", "random", "-m", "8"], input=feed, capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    p = _launch_cli(["chat", "--model", "random", "-m", "8"], input=feed, cwd=tmp_path)
    reply = lambda out: out.split(">> ")[1]  # noqa: E731  the text after the first prompt marker
    assert p.stdout.count("commands: ") == 1, p.stdout + p.stderr  # rank 1 prints nothing
    assert reply(p.stdout) == reply(ref.stdout) and reply(ref.stdout).strip()


def test_generate_prompt_from_stdin_is_refused_under_tensor_parallel(tmp_path):
    p = _launch_cli(["generate", "--prompt", "-"], input="x", cwd=tmp_path)
    assert "--prompt - cannot be used with --tensor-parallel" in p.stderr


def test_tp_bench_reports_two_ranks_beside_one(tmp_path):
    """benchmarks/tp_bench.py (the two-GPU run's script) on the CPU over the ring: one process, then two
    ranks, then --compare: greedy tokens agree (or part only at a near-tie), each rank holds about half the
    weights and at most about half the pools, and the table has every row the run asks for."""
    bench = Path(__file__).parents[1] / "benchmarks" / "tp_bench.py"
    args = ["--shape", "demo", "--bits", "0", "--levels", "1,2", "--prefill", "64", "--prompt-len", "32",
            "--gen-len", "6", "--greedy-len", "8", "--prompts", "3", "--repeats", "1"]
    one = subprocess.run([sys.executable, str(bench), *args, "--json", "one.json"], capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run_ring([sys.executable, str(bench), *args, "--group", "--backend", "ring", "--json", "two.json"],
                    cwd=tmp_path)
    assert (tmp_path / "two.json").is_file(), two.stdout[-3000:] + two.stderr[-3000:]
    r1, r2 = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert (r1["ranks"], r2["ranks"], len(r2["memory"])) == (1, 2, 2)
    assert [len(g["tokens"]) for g in r2["greedy"]] == [8, 8, 8]
    w1, c1 = r1["memory"][0]["weights_gb"], r1["memory"][0]["cache_gb"]
    assert all(0.4 * w1 <= m["weights_gb"] <= 0.6 * w1 and m["cache_gb"] <= 0.6 * c1 for m in r2["memory"])
    cmp = subprocess.run([sys.executable, str(bench), "--compare", "one.json", "two.json"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    for row in ("decode tok/s, 1 concurrent", "decode tok/s, 2 concurrent", "prefill tok/s, 64 tokens",
                "weights GB per device"):
        assert row in cmp.stdout
    assert cmp.stdout.count("greedy prompt") == 3


@pytest.mark.parametrize("gap, rc", [(0.01, 0), (0.5, 1)])
def test_tp_bench_compare_excuses_only_near_ties(tmp_path, gap, rc):
    """Two runs that part at token 1, where run one's runner-up is run two's token: a near-tie when the top-2
    gap is within --tie (2%) of the top logit, else a failure (exit 1) that says so."""
    def report(tokens, second):
        memory = [{"weights_gb": 1.0, "cache_gb": 1.0, "build_peak_gb": 1.5, "peak_gb": 2}]
        return {"shape": "demo", "bits": 0, "ranks": 1, "memory": memory,
                "greedy": [{"prompt_len": 5, "tokens": tokens,
                            "top2": [[tokens[0], 9], [tokens[1], second], [tokens[2], 9]],
                            "top2_logits": [[10.0, 5.0], [10.0, 10.0 - 10.0 * gap], [10.0, 5.0]]}]}
    (tmp_path / "a.json").write_text(json.dumps(report([1, 2, 3], 4)))
    (tmp_path / "b.json").write_text(json.dumps(report([1, 4, 5], 2)))
    bench = Path(__file__).parents[1] / "benchmarks" / "tp_bench.py"
    p = subprocess.run([sys.executable, str(bench), "--compare", "a.json", "b.json"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == rc, p.stdout + p.stderr
    assert "part at token 1 of 3 (2 against 4)" in p.stdout
    assert ("a near-tie" if rc == 0 else "NOT a near-tie") in p.stdout
