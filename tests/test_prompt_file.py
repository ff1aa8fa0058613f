"""Prompt cache files (runtime/prompt_file.py, `mtlqwen cache-prompt`, generate / serve --prompt-cache-file): an
entry exported and adopted exactly (rows per position, any block size on either side, block ids and ref counts), a
loaded prompt's greedy continuation equal to a fresh engine's with its tokens restored, drafter rows included, every
foreign or broken file refused before anything is allocated, and the command line end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import httpx
import mlx.core as mx
import numpy as np
import pytest

import mtlqwen
from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, greedy, run_checking_drafter_context
from frontend_fixtures import ServerProcess, subprocess_env, write_tiny_chat_checkpoint
from hf_checkpoints import random_token_ids, write_tiny_checkpoint
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine
from mtlqwen.runtime import prompt_file
from mtlqwen.runtime.kv_manager import KVManager
from mtlqwen.runtime.sequence import Sequence, SeqStatus


def fake_cache(bt: int, blocks: int = 16, slots: int = 4, base: float = 0.0):
    """The pools an entry touches, every element distinct: GDN states by slot, K/V by block and row."""
    ar = lambda n, *shape: base + mx.arange(n * int(np.prod(shape)), dtype=mx.float32).reshape(n, *shape)  # noqa: E731
    return SimpleNamespace(conv_states=[ar(slots, 2) + 1e5], rec_states=[ar(slots, 3) + 2e5],
                           k_pools=[ar(blocks, bt, 2, 1) + 3e5], v_pools=[ar(blocks, bt, 2, 1) + 4e5], drafter_cache=None)


def finished(kv, tokens, slot, cache):
    """A sequence that computed `tokens` in `slot` and finished: its turn entry kept."""
    s = Sequence("owner", list(tokens), greedy(4), seed=0)
    s.slot, s.status = slot, SeqStatus.RUNNING
    kv.allocate(s, len(tokens))
    kv.advance(s, len(tokens))
    kv.finish(s, "length", cache)
    kv.free(s)
    return s


def test_an_entry_exported_and_adopted_into_another_block_size_exactly():
    src_kv, src = KVManager(16, 4, prefix_interval=8, identity="a"), fake_cache(4)
    tokens = list(range(100, 114))  # 14 tokens: blocks 0-2 whole, block 3 holds 2 (the entry's partial copy)
    finished(src_kv, tokens, slot=2, cache=src)
    rows, state = src_kv.export(tokens, src)
    k = np.array(src.k_pools[0])
    assert np.array_equal(np.array(rows[0]), k.reshape(64, 2, 1)[:14])  # positions 0..13: blocks 0, 1, 2, 3[:2]
    assert np.array_equal(np.array(rows[1]), np.array(src.v_pools[0]).reshape(64, 2, 1)[:14])
    assert np.array_equal(np.array(state[0]), np.array(src.conv_states[0][2]))
    assert np.array_equal(np.array(state[1]), np.array(src.rec_states[0][2]))
    assert src_kv.export(tokens[:13], src) is None and src_kv.export(tokens + [1], src) is None  # exact lengths only

    kv, dst = KVManager(10, 8, prefix_interval=8, identity="b"), fake_cache(8, blocks=10, base=-1e6)
    e = kv.adopt(tokens, rows, state, dst)
    # one whole block of 8 (the first free, 0, owned by the entry alone), rows 8..13 as the partial block
    assert (e.kind, e.length, e.blocks, kv.pool.ref_counts[:2], kv.pool.num_free) == ("turn", 14, [0], [1, 0], 9)
    assert np.array_equal(np.array(dst.k_pools[0][0]), np.array(rows[0][:8]))
    assert np.array_equal(np.array(dst.v_pools[0][0]), np.array(rows[1][:8]))
    assert np.array_equal(np.array(e.tail[0][0, :6]), np.array(rows[0][8:])) and not np.array(e.tail[0][0, 6:]).any()
    assert np.array_equal(np.array(e.state[1][0]), np.array(state[1]))
    assert np.array_equal(np.array(dst.k_pools[0][1]), np.array(fake_cache(8, blocks=10, base=-1e6).k_pools[0][1]))
    assert kv.prefix.exact(tokens) is e and kv.prefix.stats()["prefix_turns_kept"] == 0
    assert kv.adopt(tokens, rows, state, dst) is None and kv.pool.num_free == 9  # cached already: nothing taken

    # a request extending the prompt restores it: the whole block shared, the partial one copied into its own
    probe = Sequence("probe", tokens + [7, 8], greedy(1), seed=0)
    probe.slot = 1
    kv.admit(probe)
    assert (probe.kv_valid, probe.block_table, kv.pool.ref_counts[:2]) == (14, [0, 1], [2, 1])
    kv.prefix.restore([probe], dst)
    assert np.array_equal(np.array(dst.k_pools[0][1][:6]), np.array(rows[0][8:]))
    assert np.array_equal(np.array(dst.rec_states[0][1]), np.array(state[1]))
    kv.free(probe)
    assert kv.clear() == 1 and kv.pool.num_free == 10


def test_adopt_evicts_for_room_and_refuses_what_cannot_fit():
    kv, cache = KVManager(4, 4, prefix_interval=4, identity="c"), fake_cache(4, blocks=4)
    rows = [mx.ones((12, 2, 1))] * 2
    state = [mx.ones((2,)), mx.ones((3,))]
    first = kv.adopt(list(range(12)), rows, state, cache)
    assert first.blocks == [0, 1, 2] and kv.pool.num_free == 1
    second = kv.adopt(list(range(50, 62)), rows, state, cache)  # needs 3 blocks: the first entry is evicted
    # block 3 was free; the evicted entry's blocks came back tail first (BlockPool.free): 2, 1, 0
    assert second.blocks == [3, 2, 1] and list(kv.prefix.entries.values()) == [second]
    with pytest.raises(ValueError, match="needs 5 free blocks of 4 tokens, 4 of 4 are free"):
        kv.adopt(list(range(20)), [mx.ones((20, 2, 1))] * 2, state, cache)
    assert kv.pool.num_free == 4 and not kv.prefix.entries  # evicted trying, nothing taken
    tiny = KVManager(8, 4, prefix_interval=4, prefix_cache_bytes=8, identity="d")
    assert tiny.adopt(list(range(6)), [mx.ones((6, 2, 1))] * 2, state, fake_cache(4, blocks=8)) is None
    assert tiny.pool.num_free == 8  # over the budget: dropped, its block back
    with pytest.raises(ValueError, match="prefix cache is off"):
        KVManager(8, 4, identity="e").adopt([1, 2], rows, state, cache)


@pytest.mark.parametrize("length", [1, 16, 37, 64, 100])
def test_a_loaded_prompt_continues_as_a_fresh_engine_does(model, tmp_path, length):
    prompt = random_token_ids(length, 500, seed=length)
    rest = random_token_ids(9, 500, seed=1000 + length)
    writer = Engine(model, block_tokens=16, prefix_interval=32, num_blocks=24)
    saved = writer.save_prompt_cache(tmp_path / "p", prompt, {"note": "x"})
    assert saved.path == str(tmp_path / "p.safetensors") and saved.tokens == prompt and saved.request == {"note": "x"}
    assert prompt_file.read(tmp_path / "p").tokens == prompt  # the name as given finds the written file

    reader = Engine(model, block_tokens=32, prefix_interval=64, num_blocks=12)
    header, new = reader.load_prompt_cache(saved.path)
    assert new and header.tokens == prompt and reader.stats()["prefix_entries"] == 1
    used = reader.stats()["total_blocks"] - reader.stats()["free_blocks"]
    assert used == length // 32  # whole blocks only; the rest is the entry's partial copy
    assert reader.load_prompt_cache(saved.path)[1] is False  # cached already

    sp = greedy(10, ignore_eos=True)
    (out,) = reader.generate([prompt + rest], sp)
    (fresh,) = Engine(model, block_tokens=32, prefix_interval=64, num_blocks=12).generate([prompt + rest], sp)
    assert out.cached_tokens == length and out.token_ids == fresh.token_ids
    assert_idle(reader)


def test_save_runs_the_prompt_once_and_needs_the_prefix_cache(model, tmp_path):
    eng = Engine(model, block_tokens=16, prefix_interval=32, num_blocks=24)
    prompt = random_token_ids(40, 500, seed=3)
    eng.save_prompt_cache(tmp_path / "a", prompt)
    steps = eng.counters["steps"]
    eng.save_prompt_cache(tmp_path / "b", prompt)  # the entry is there: no step runs
    assert eng.counters["steps"] == steps
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with pytest.raises(ValueError, match="need the prefix cache"):
        Engine(model, prefix_interval=0).save_prompt_cache(tmp_path / "c", prompt)
    with pytest.raises(ValueError, match="need the prefix cache"):
        Engine(model, prefix_interval=0).load_prompt_cache(tmp_path / "a")
    assert_idle(eng)


def test_foreign_and_broken_files_are_refused_before_anything_is_taken(model, tmp_path_factory, tmp_path):
    path = Engine(model, block_tokens=16, num_blocks=24).save_prompt_cache(tmp_path / "p", list(range(5, 45))).path
    other = mtlqwen.load(write_tiny_checkpoint(tmp_path_factory.mktemp("other"), seed=1))
    fresh = Engine(other, block_tokens=16, num_blocks=24)
    with pytest.raises(ValueError, match="does not fit this engine: the weights differ"):
        fresh.load_prompt_cache(path)
    with pytest.raises(FileNotFoundError, match="no prompt cache file"):
        fresh.load_prompt_cache(tmp_path / "none.safetensors")
    arrays, meta = mx.load(path, return_metadata=True)

    def broken(name, arrays=arrays, **changes):
        f = str(tmp_path / f"{name}.safetensors")
        mx.save_safetensors(f, arrays, metadata={**meta, **changes})
        return f

    eng = Engine(model, block_tokens=16, num_blocks=24)
    cases = [
        (broken("fmt", format="something"), "is not an mtlqwen prompt cache"),
        (broken("ver", version="0"), "format version '0'"),
        (broken("dtype", dtype="mlx.core.float16"), "the dtype differs"),
        (broken("shape", arrays={**arrays, "kv.0": arrays["kv.0"][:-1]}), "array kv.0 is"),
        (broken("gone", arrays={k: v for k, v in arrays.items() if k != "state.1"}), "array state.1 is missing"),
        (broken("extra", arrays={**arrays, "kv.99": arrays["kv.0"]}), "no pool for: kv.99"),
        (broken("req", request="{"), "request metadata is not JSON"),
    ]
    for f, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.load_prompt_cache(f)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        eng.load_prompt_cache(tmp_path / "junk.safetensors")
    assert_idle(eng)  # nothing was taken by any refusal


def test_drafter_rows_travel_with_the_prompt(model, ckpt, tmp_path_factory, tmp_path):
    drafter = load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2), model)
    prompt = random_token_ids(45, 500, seed=21)
    kw = dict(slots=1, step_tokens=16, block_tokens=16, num_blocks=12, n_draft=3, prefix_interval=20)
    path = Engine(model, draft=drafter, **kw).save_prompt_cache(tmp_path / "d", prompt).path
    with pytest.raises(ValueError, match="the drafter differs"):
        Engine(model, block_tokens=16, num_blocks=12).load_prompt_cache(path)
    eng = Engine(model, draft=drafter, **kw)
    assert eng.load_prompt_cache(path)[1]
    sp = greedy(12, ignore_eos=True)
    rid = eng.submit(prompt + random_token_ids(30, 500, seed=22), sp)
    outs, checked = run_checking_drafter_context(eng, model, drafter)  # the restored drafter rows are exact
    (plain,) = Engine(model, slots=1, step_tokens=16, block_tokens=16, num_blocks=12).generate(
        [prompt + random_token_ids(30, 500, seed=22)], sp)
    assert checked >= 3 and outs[rid].cached_tokens == 45 and outs[rid].token_ids == plain.token_ids
    assert_idle(eng)


# ---- the command line


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtlqwen", *args], capture_output=True, text=True, timeout=180,
                          env=subprocess_env())


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat"), eos_reachable=False)


def generated(stdout: str) -> str:
    return stdout.split("=" * 10)[1]


def test_cache_prompt_then_generate_continues_the_user_message(chat_ckpt, tmp_path):
    doc = "The quick brown fox jumps over the lazy dog. " * 12
    r = run_cli("cache-prompt", "--model", str(chat_ckpt), "--prompt", doc, "--system-prompt", "Be brief.",
                "--chat-template-args", '{"enable_thinking": false}', "--prompt-cache-file", str(tmp_path / "doc"))
    assert r.returncode == 0, r.stderr
    n = int(r.stdout.split("Prompt: ")[1].split()[0])
    assert f"Saved {tmp_path / 'doc.safetensors'}" in r.stdout
    header = prompt_file.read(tmp_path / "doc.safetensors")
    assert len(header.tokens) == n and header.request["model"] == str(chat_ckpt)
    assert header.request["prompt"] == doc and header.request["system_prompt"] == "Be brief."

    cached = run_cli("generate", "--prompt-cache-file", str(tmp_path / "doc.safetensors"), "-p", "Who jumps?",
                     "-m", "8")
    whole = run_cli("generate", "--model", str(chat_ckpt), "--system-prompt", "Be brief.", "--chat-template-args",
                    '{"enable_thinking": false}', "-p", doc + "Who jumps?", "-m", "8")
    assert cached.returncode == whole.returncode == 0, cached.stderr + whole.stderr
    total = int(whole.stdout.split("Prompt: ")[1].split()[0])
    assert f"Prompt: {total - n} tokens" in cached.stdout and f"({n} more from the prompt cache)" in cached.stdout
    assert generated(cached.stdout) == generated(whole.stdout)

    clash = run_cli("generate", "--prompt-cache-file", str(tmp_path / "doc"), "--system-prompt", "Other.", "-p", "x")
    assert clash.returncode == 1 and "--system-prompt differs from the prompt cache's ('Be brief.')" in clash.stderr
    same = run_cli("generate", "--prompt-cache-file", str(tmp_path / "doc"), "--chat-template-args",
                   '{ "enable_thinking" : false }', "-p", "x", "-m", "2")
    assert same.returncode == 0, same.stderr  # the same settings spelled otherwise
    other = write_tiny_chat_checkpoint(tmp_path / "other", seed=1, eos_reachable=False)
    foreign = run_cli("generate", "--prompt-cache-file", str(tmp_path / "doc"), "--model", str(other), "-p", "x")
    assert foreign.returncode == 1 and "does not fit this engine: the weights differ" in foreign.stderr
    assert f"(it was written with --model {chat_ckpt})" in foreign.stderr


def test_cache_prompt_refuses_what_cannot_apply(chat_ckpt, tmp_path):
    r = run_cli("cache-prompt", "--model", str(chat_ckpt), "--ignore-chat-template", "--system-prompt", "s",
                "--prompt-cache-file", str(tmp_path / "x"))
    assert r.returncode == 1 and "--system-prompt does not apply with --ignore-chat-template" in r.stderr
    r = run_cli("cache-prompt", "--model", str(chat_ckpt), "--ignore-chat-template", "--prompt-cache-file",
                str(tmp_path / "x"))
    assert r.returncode == 1 and "nothing to cache" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_serve_starts_with_the_system_prompt_cached(chat_ckpt, tmp_path):
    r = run_cli("cache-prompt", "--model", str(chat_ckpt), "--system-prompt", "You answer in haiku.",
                "--prompt-cache-file", str(tmp_path / "sys"))
    assert r.returncode == 0, r.stderr
    n = len(prompt_file.read(tmp_path / "sys.safetensors").tokens)
    bad = run_cli("serve", "--model", str(chat_ckpt), "--prompt-cache-file", str(tmp_path / "missing"))
    assert bad.returncode == 1 and "no prompt cache file" in bad.stderr
    s = ServerProcess(["--model", str(chat_ckpt), "--slots", "1", "--num-blocks", "32", "--block-tokens", "16",
                       "--prompt-cache-file", str(tmp_path / "sys.safetensors")], tmp_path / "serve.log")
    try:
        s.wait_healthy()
        body = {"messages": [{"role": "system", "content": "You answer in haiku."},
                             {"role": "user", "content": "Name a fox."}], "max_tokens": 4, "temperature": 0}
        got = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=60).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n, json.dumps(got)
        body["messages"][0]["content"] = "You answer in prose."
        got = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=60).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < n
    finally:
        s.stop()


def test_a_longer_prompt_adopted_shares_the_blocks_of_the_entry_it_extends():
    kv, cache = KVManager(12, 4, prefix_interval=8, identity="f"), fake_cache(4, blocks=12)
    a = list(range(100, 114))  # 14 tokens: 3 whole blocks + a partial one
    rows = lambda n: [mx.arange(n * 2, dtype=mx.float32).reshape(n, 2, 1) + 1000 * j for j in range(2)]  # noqa: E731
    state = [mx.ones((2,)), mx.ones((3,))]
    first = kv.adopt(a, rows(14), state, cache)
    second = kv.adopt(a + [7] * 6, rows(20), state, cache)  # 20 tokens: 5 whole blocks, the first 3 first's
    assert first.blocks == [0, 1, 2] and second.blocks == [0, 1, 2, 3, 4] and second.tail is None
    assert kv.pool.ref_counts[:6] == [2, 2, 2, 1, 1, 0] and kv.pool.num_free == 7
    assert np.array_equal(np.array(cache.k_pools[0][3:5]).reshape(8, 2, 1), np.array(rows(20)[0][12:20]))
    assert kv.prefix.maximal() == [second]  # first's tokens are a prefix of second's
    salted = kv.adopt(a, rows(14), state, cache, salt="tenant")
    assert salted is not None and salted.salt == "tenant" and kv.prefix.exact(a, "tenant") is salted
    assert salted.blocks == [5, 6, 7]  # nothing shared across salts
    assert kv.prefix.maximal() == [second, salted]
    assert kv.clear() == 3 and kv.pool.num_free == 12


def test_the_prefix_cache_is_saved_and_restored_across_engines(model, tmp_path):
    """A two-turn chat and a salted prompt; the entries no other extends saved, then loaded by another engine of
    another block size: the third turn restores the second's end, the salted prompt only under its salt, and the
    replies are a fresh engine's."""
    sp = greedy(6, ignore_eos=True)
    kw = dict(block_tokens=16, prefix_interval=32, num_blocks=40)
    turn1 = random_token_ids(40, 500, seed=5)
    eng = Engine(model, **kw)
    (r1,) = eng.generate([turn1], sp)
    turn2 = turn1 + r1.token_ids + random_token_ids(7, 500, seed=6)
    (r2,) = eng.generate([turn2], sp)
    (s1,) = eng.generate([random_token_ids(20, 500, seed=7)], greedy(3, ignore_eos=True, cache_salt="t"))
    files = eng.save_prefix_cache(tmp_path / "pc")
    assert len(files) == len(eng.prefix.maximal()) == 2  # turn 2's end (turn 1's inside it) and the salted one
    assert sorted(p.name for p in (tmp_path / "pc").iterdir()) == sorted(f.rsplit("/", 1)[1] for f in files)

    other = Engine(model, block_tokens=32, prefix_interval=64, num_blocks=20)
    assert other.load_prefix_cache(tmp_path / "pc") == (2, [])
    turn3 = turn2 + r2.token_ids + random_token_ids(5, 500, seed=8)
    (r3,) = other.generate([turn3], sp)
    (fresh,) = Engine(model, block_tokens=32, prefix_interval=0, num_blocks=20).generate([turn3], sp)
    assert r3.cached_tokens == len(turn2) + len(r2.token_ids) - 1 and r3.token_ids == fresh.token_ids
    salted = random_token_ids(20, 500, seed=7) + s1.token_ids[:2] + [9]  # its turn: the 2 reply tokens that ran
    (plain,) = other.generate([salted], greedy(2))
    (same,) = other.generate([salted], greedy(2, cache_salt="t"))
    assert plain.cached_tokens == 0 and same.cached_tokens == 22
    foreign = tmp_path / "pc" / "foreign.safetensors"  # another model's file: left alone
    foreign.write_bytes((tmp_path / "pc" / files[0].rsplit("/", 1)[1]).read_bytes())
    arrays, meta = mx.load(str(foreign), return_metadata=True)
    mx.save_safetensors(str(foreign), arrays, metadata={**meta, "weights": "another"})
    (tmp_path / "pc" / "x.part.safetensors").write_bytes(b"cut short")  # an unfinished write: removed
    written = other.save_prefix_cache(tmp_path / "pc")  # the old files replaced by the new ends
    assert sorted(p.name for p in (tmp_path / "pc").iterdir()) == sorted(
        [f.rsplit("/", 1)[1] for f in written] + ["foreign.safetensors"])
    assert other.load_prefix_cache(tmp_path / "pc")[1] == [
        f"'{foreign}' does not fit this engine: the weights differ (it was written with --model {model.source}); "
        "a saved state only fits the same model weights, dtype and drafter"]
    assert_idle(other)


def test_serve_keeps_its_prefix_cache_across_a_restart(chat_ckpt, tmp_path):
    """--prefix-cache-dir: a prompt's end written when the server stops, restored when it starts again: a prompt
    that extends it prefills only the rest."""
    folder = tmp_path / "pc"
    args = ["--model", str(chat_ckpt), "--slots", "1", "--num-blocks", "32", "--block-tokens", "16",
            "--prefix-cache-dir", str(folder), "--log-level", "info"]
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    s = ServerProcess(args, tmp_path / "first.log")
    try:
        s.wait_healthy()  # one token: the sampled token never runs, so the turn entry is the prompt exactly
        first = httpx.post(s.base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()
    finally:
        s.stop()  # SIGTERM: a graceful stop, which writes the cache
    assert "1 entries written to" in (tmp_path / "first.log").read_text()
    assert [p.suffix for p in folder.iterdir()] == [".safetensors"]
    s = ServerProcess(args, tmp_path / "second.log")
    try:
        s.wait_healthy()
        again = httpx.post(s.base + "/v1/completions", json={"prompt": prompt + "Again?", "max_tokens": 2},
                           timeout=60).json()
    finally:
        s.stop()
    assert "1 entries loaded from" in (tmp_path / "second.log").read_text()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"], again
    bad = run_cli("serve", "--model", str(chat_ckpt), "--prefix-cache-dir", str(tmp_path / "first.log"))
    assert bad.returncode == 1 and "is not a writable directory" in bad.stderr


def test_an_adoption_that_cannot_fit_gives_back_the_blocks_it_would_have_shared():
    """The entry a prompt extends is evicted to make room, the room is still short: nothing stays taken."""
    kv, cache = KVManager(5, 4, prefix_interval=4, identity="g"), fake_cache(4, blocks=5)
    rows = lambda n: [mx.ones((n, 2, 1))] * 2  # noqa: E731
    state = [mx.ones((2,)), mx.ones((3,))]
    a = list(range(12))
    assert kv.adopt(a, rows(12), state, cache).blocks == [0, 1, 2]
    with pytest.raises(ValueError, match="needs 3 free blocks of 4 tokens beside the 3 it shares, 2 of 5 are free"):
        kv.adopt(a + list(range(50, 62)), rows(24), state, cache)  # 6 blocks: 3 shared with a's + 3 fresh
    assert not kv.prefix.entries and kv.pool.num_free == 5 and kv.pool.ref_counts == [0] * 5
