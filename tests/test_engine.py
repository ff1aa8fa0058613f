"""The engine end to end on a tiny random Qwen3.5 (CPU): greedy outputs equal the model run on each
request alone, whatever the batching, chunking, arrival times and preemptions; bad requests fail
alone; cancellation, streaming, stops, memory behaviour."""


import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.kernels import gpu_backend
from mtlqwen.model import QuantSpec
from mtlqwen.runtime.block_pool import BlockPool

from engine_checks import assert_idle, assert_reference, greedy, ref_logits, run_arrivals
from hf_checkpoints import random_token_ids

@st.composite
def workloads(draw):
    slots = draw(st.integers(1, 8))
    short = draw(st.lists(st.integers(1, 48), min_size=6, max_size=28))
    long_ = draw(st.lists(st.integers(49, 700), min_size=0, max_size=2))
    lens = draw(st.permutations(short + long_))
    reqs = [
        (draw(st.integers(0, 12)), n, draw(st.integers(1, 6)), draw(st.integers(0, 2**20)))
        for n in lens
    ]
    return dict(
        slots=slots,
        step_tokens=draw(st.integers(max(16, slots), 128)),
        block_tokens=draw(st.sampled_from([16, 32])),
        extra_blocks=draw(st.integers(0, 24)),
        reqs=reqs,
    )


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=workloads())
def test_random_workloads_match_each_request_alone(model, w):
    bt = w["block_tokens"]
    requests = [
        (arrive, random_token_ids(n, 512, seed), SamplingParams(max_tokens=mt)) for arrive, n, mt, seed in w["reqs"]
    ]
    # the largest request must fit alone; the extra blocks decide how often sequences get preempted
    need = max(BlockPool.blocks_for(len(p) + sp.max_tokens - 1, bt) for _, p, sp in requests)
    eng = Engine(model, slots=w["slots"], step_tokens=w["step_tokens"], block_tokens=bt, num_blocks=need + w["extra_blocks"])
    outs = run_arrivals(eng, requests)
    for (_, prompt, sp), out in zip(requests, outs):
        assert out.prompt_tokens == len(prompt)
        assert_reference(model, prompt, out, sp.max_tokens)
    assert_idle(eng)
    assert eng.stats()["generated_tokens"] == sum(len(o.token_ids) for o in outs)


def test_preemption_under_a_tight_pool_is_exact(model):
    prompts = [random_token_ids(n, 512, seed=n) for n in (40, 33, 70, 5, 18, 61)]
    eng = Engine(model, slots=4, step_tokens=32, prefill_step_tokens=32, block_tokens=16, num_blocks=7)
    outs = eng.generate(prompts, greedy(8))
    assert eng.stats()["preemptions"] > 0
    assert sum(o.num_preemptions for o in outs) == eng.stats()["preemptions"]
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 8)
    assert_idle(eng)


def test_bad_requests_fail_alone(model):
    good = [random_token_ids(n, 512, seed=100 + n) for n in (9, 23)]
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=20)
    prompts = [good[0], [], [3, 600, 4], [i % 500 for i in range(4097)], good[1], "some text", [5, 6], [7] * 300, [1, 2.5]]
    sampling = [greedy(5)] * 6 + [{"max_tokens": 0}, greedy(30), greedy(5)]
    outs = eng.generate(prompts, sampling)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length", "error", "error", "error", "error"]
    errors = [o.error for o in outs]
    assert "empty prompt" in errors[1]
    assert "token id 600 is outside the vocabulary [0, 512)" in errors[2]
    assert "exceeds the context of 4096 tokens" in errors[3]
    assert "no tokenizer" in errors[5]
    assert "max_tokens" in errors[6]
    assert "needs 21 KV blocks" in errors[7] and "pool has 20" in errors[7]
    assert "integer token ids" in errors[8]
    assert all(o.token_ids == [] for o in outs if o.finish_reason == "error")
    assert_reference(model, good[0], outs[0], 5)
    assert_reference(model, good[1], outs[4], 5)
    for bad in ([], [600]):
        with pytest.raises(ValueError):
            eng.submit(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert_idle(eng)


def test_cancel_frees_slot_and_blocks_at_once(model):
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=16, num_blocks=40)
    a = eng.submit(random_token_ids(60, 512, seed=1), greedy(20))
    b_prompt = random_token_ids(30, 512, seed=2)
    b = eng.submit(b_prompt, greedy(4))
    for _ in range(3):
        eng.step()
    held = eng.stats()["total_blocks"] - eng.stats()["free_blocks"]
    a_blocks = len(eng._seqs[a].block_table)
    assert a_blocks > 0 and eng.stats()["running"] == 2
    assert eng.cancel(a) and not eng.cancel(a) and not eng.cancel("nope")
    assert eng.stats()["free_blocks"] == eng.stats()["total_blocks"] - (held - a_blocks)
    assert eng.stats()["running"] == 1 and eng.stats()["free_slots"] == 1
    deltas = eng.step()
    (cancelled,) = [d for d in deltas if d.request_id == a]
    assert cancelled.finished and cancelled.finish_reason == "cancelled"
    outs = {}
    while eng.has_work():
        for d in eng.step():
            assert d.request_id != a
            if d.finished:
                outs[d.request_id] = d.output
    assert_reference(model, b_prompt, outs[b], 4)
    assert_idle(eng)


class FakeTokenizer:
    """Token t is the text "<t>"; encode reads space-separated ids."""

    eos_token_ids = []

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def detokenizer(self):
        return _FakeStream()


class _FakeStream:
    def add(self, i):
        return f"<{i}>"

    def finish(self):
        return ""


def _stream_all(eng, prompts, sampling):
    toks, texts, final = {}, {}, {}
    for d in eng.stream(prompts, sampling):
        toks.setdefault(d.request_id, []).extend(d.token_ids)
        texts[d.request_id] = texts.get(d.request_id, "") + d.text
        if d.finished:
            final[d.request_id] = d.output
    return toks, texts, final


def test_stream_stop_tokens_and_stop_strings(model):
    tok = FakeTokenizer()
    prompt = random_token_ids(12, 512, seed=5)
    eng = Engine(model, slots=3, step_tokens=32, block_tokens=16, num_blocks=30, tokenizer=tok)
    (full,) = eng.generate([" ".join(map(str, prompt))], greedy(8))
    assert_reference(model, prompt, full, 8)
    out = full.token_ids
    assert full.text == tok.decode(out)
    k = out.index(out[3])  # first occurrence of the stop token
    by_id = greedy(8, stop_token_ids=[out[3]])
    across = f"{out[1]}><{out[2]}"  # a stop string spanning two tokens
    by_str = greedy(8, stop=["<zzz>", across])
    toks, texts, final = _stream_all(eng, [prompt, prompt, prompt], [by_id, by_str, greedy(8)])
    rid_id, rid_str, rid_full = sorted(final)
    assert final[rid_id].token_ids == out[: k + 1] and final[rid_id].finish_reason == "stop"
    assert final[rid_id].text == tok.decode(out[:k])  # the stop token's text is not part of the completion
    cut = tok.decode(out).find(across)
    assert final[rid_str].finish_reason == "stop" and final[rid_str].text == tok.decode(out)[:cut]
    assert final[rid_str].token_ids == out[:3]
    assert final[rid_full].text == full.text and final[rid_full].token_ids == out
    # what stopped each: the stop token id, the stop string (not "<zzz>", which never occurs), nothing
    assert [final[r].stop_reason for r in (rid_id, rid_str, rid_full)] == [out[3], across, None]
    for rid in final:  # deltas add up to the outputs; held-back text is released at the end
        assert toks[rid] == final[rid].token_ids and texts[rid] == final[rid].text
    # EOS: the model's eos ids end a completion unless ignore_eos
    eng.eos = {out[2]}
    (stopped, ignored) = eng.generate([prompt, prompt], [greedy(8), greedy(8, ignore_eos=True)])
    assert stopped.token_ids == out[: out.index(out[2]) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == out and ignored.finish_reason == "length"
    assert_idle(eng)


def test_seeded_sampling_is_independent_of_batching_and_preemption(model):
    prompt = random_token_ids(20, 512, seed=9)
    hot = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234)
    alone = Engine(model, slots=1, step_tokens=16, block_tokens=16, num_blocks=8).generate([prompt], hot)[0]
    others = [random_token_ids(n, 512, seed=n) for n in (50, 7, 33)]
    eng = Engine(model, slots=4, step_tokens=16, block_tokens=16, num_blocks=6)
    outs = eng.generate(others + [prompt], [greedy(10)] * 3 + [hot])
    assert eng.stats()["preemptions"] > 0
    assert outs[-1].token_ids == alone.token_ids
    other_seed = Engine(model, slots=1, step_tokens=16, block_tokens=16, num_blocks=8).generate(
        [prompt], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=4321))[0]
    assert other_seed.token_ids != alone.token_ids


def test_blocks_are_taken_only_as_tokens_cross_boundaries(model):
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=16, num_blocks=12)
    eng.submit(random_token_ids(20, 512, seed=3), greedy(30))
    eng.submit(random_token_ids(3, 512, seed=4), greedy(30))
    seen = set()
    while eng.has_work():
        eng.step()
        tables = []
        for s in eng.scheduler.running:
            assert len(s.block_table) == BlockPool.blocks_for(s.kv_valid, 16)
            seen.add(len(s.block_table))
            tables += s.block_table
        # the rest is held by prefix-cache entries (a finished request's turn entry)
        held = {b for e in eng.prefix.entries.values() for b in e.blocks}
        assert len(set(tables)) == len(tables) and eng.pool.num_used == len(set(tables) | held)
    assert {1, 2, 3} <= seen
    assert_idle(eng)


def test_a_step_writes_the_kv_pools_in_place(model):
    # 4 pools (2 attention layers x K/V) of 8192 x 16 x 2 x 64 fp32 = 64 MiB each: a copy would show
    # as a full pool, far above a back-end's workspace noise (a cuBLAS workspace is ~10 MB)
    eng = Engine(model, slots=4, step_tokens=32, block_tokens=16, num_blocks=8192)
    pool_bytes = eng.cache.k_pools[0].nbytes
    for i in range(4):
        eng.submit(random_token_ids(30 + i, 512, seed=i), greedy(12))
    assert step_peak(eng, warm=3, steps=4) < pool_bytes // 2, "a step copied a KV pool"


def test_padding_to_buckets_is_exact(model):
    prompts = [random_token_ids(n, 512, seed=n) for n in (21, 5, 44)]
    eng = Engine(model, slots=3, step_tokens=32, prefill_step_tokens=32, block_tokens=16, num_blocks=16,
                 pad_buckets=True)
    assert eng.buckets == [1, 2, 4, 8, 16, 32]
    outs = eng.generate(prompts, greedy(5))
    assert eng.stats()["padding_tokens"] > 0
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 5)
    assert_idle(eng)


def test_engine_from_a_path_with_the_step_api(ckpt, model):
    eng = Engine(str(ckpt), slots=2, step_tokens=16, block_tokens=32, num_blocks=10)
    assert eng.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        eng.submit("hello")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.submit([1, 2], greedy(3, stop=["x"]))
    prompt = random_token_ids(7, 512, seed=11)
    rid = eng.submit(prompt, greedy(4), request_id="r1")
    with pytest.raises(ValueError, match="already live"):
        eng.submit(prompt, request_id="r1")
    got = []
    while eng.has_work():
        for d in eng.step():
            assert d.request_id == rid
            got.extend(d.token_ids)
            last = d
    assert last.finished and last.output.token_ids == got
    assert last.output.ttft is not None and last.output.total_time >= last.output.ttft > 0
    assert_reference(model, prompt, last.output, 4)
    s = eng.stats()
    for key in ("total_blocks", "free_blocks", "running", "waiting", "prompt_tokens", "generated_tokens", "preemptions"):
        assert key in s
    assert (s["prompt_tokens"], s["generated_tokens"], s["total_blocks"]) == (7, 4, 10)
    (single,) = eng.generate(prompt, greedy(4), progress=True)  # one token-id prompt -> one output
    assert single.token_ids == got


def _decode_peak(model, vocab, num_blocks):
    """Peak memory of 6 decode steps of 4 sequences over the settled state, and one K pool's bytes."""
    eng = Engine(model, slots=4, step_tokens=128, block_tokens=128, num_blocks=num_blocks)
    for i, n in enumerate((200, 150, 90, 60)):
        eng.submit(random_token_ids(n, vocab, seed=i), greedy(24))
    # the prompts (500 tokens) are prefilled by step 5
    return step_peak(eng, warm=6, steps=6), eng.cache.k_pools[0].nbytes


def step_peak(eng, warm: int, steps: int) -> int:
    """Bytes above the settled memory at the peak of `steps` steps after `warm` steps; then runs to the end."""
    for _ in range(warm):
        eng.step()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(steps):
        eng.step()
    mx.synchronize()
    peak = mx.get_peak_memory() - base
    while eng.has_work():
        eng.step()
    return peak


@pytest.mark.gpu
@pytest.mark.skipif(gpu_backend() is None, reason="needs a GPU back-end (Metal or CUDA)")
def test_gpu_kernels_engine_matches_single_sequence_and_writes_in_place():
    """Qwen3.5-9B layer geometry (4 layers, 4-bit, smaller vocab): the engine on the GPU kernels vs
    the one-shot forward, and KV pools written in place."""
    from mtlqwen.model.builtin import qwen35_9b_config, random_model

    c = qwen35_9b_config()
    c.num_hidden_layers, c.layer_types, c.vocab_size = 4, c.layer_types[:4], 16384
    model = random_model(config=c, quantize=QuantSpec(4, 64))
    prompts = [random_token_ids(n, c.vocab_size, seed=n) for n in (300, 40, 129, 7, 1)]
    eng = Engine(model, slots=4, step_tokens=128, block_tokens=128, num_blocks=64)
    outs = eng.generate(prompts, greedy(16))
    gaps = []
    for p, o in zip(prompts, outs):
        rows = ref_logits(model, p + o.token_ids[:-1])[len(p) - 1 :]
        gaps += [(row.max() - row[t]) / np.abs(row).max() for t, row in zip(o.token_ids, rows)]
    differ = sum(g > 0 for g in gaps)
    print(f"GPU engine vs one-shot: {differ} of {len(gaps)} tokens differ, worst gap {max(gaps):.2e}")
    # bf16 activations: chunked and one-shot round differently, so only near-ties may flip
    assert differ <= 0.15 * len(gaps) and max(gaps) <= 0.1
    assert_idle(eng)

    # kernels may allocate workspaces; a pool copy is what grows with the pool, so compare two sizes
    small, small_pool = _decode_peak(model, c.vocab_size, 128)
    large, large_pool = _decode_peak(model, c.vocab_size, 512)
    print(f"decode peak over base: {small / 2**20:.1f} MiB with {small_pool / 2**20:.0f} MiB K pools, "
          f"{large / 2**20:.1f} MiB with {large_pool / 2**20:.0f} MiB")
    assert large - small < (large_pool - small_pool) // 2, "a step copied a KV pool"


def test_no_work_left_after_a_stop_token(model):
    """A request that stops on a stop token was already sent into the next step (one-step overlap):
    once it has finished, the engine reports no work, holds nothing, and a further step says nothing."""
    prompt = random_token_ids(20, 512, seed=5)
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=8)
    (plain,) = eng.generate([prompt], greedy(6))
    stop = plain.token_ids[2]
    (out,) = eng.generate([prompt], greedy(6, stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.token_ids == plain.token_ids[: plain.token_ids.index(stop) + 1]
    assert not eng.has_work()
    assert eng.step() == []
    assert_idle(eng)


def test_next_step_is_launched_before_this_steps_tokens_are_read(model, monkeypatch):
    """The one host/device overlap rule: step N+1's graph is built and launched before step N's sampled
    tokens are read back (the only sync), so host work for N+1 runs while the device computes N."""
    events = []
    launch, commit = Engine._launch, Engine._commit

    def spy_launch(self, plan):
        flight = launch(self, plan)
        events.append(("launch", flight))  # the objects themselves: ids could be reused
        return flight

    def spy_commit(self, flight):
        events.append(("commit", flight))
        return commit(self, flight)

    monkeypatch.setattr(Engine, "_launch", spy_launch)
    monkeypatch.setattr(Engine, "_commit", spy_commit)
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=8, prefix_interval=0)
    eng.generate([random_token_ids(10, 512, seed=1), random_token_ids(3, 512, seed=2)], greedy(5))
    def at(kind, flight):
        return next(i for i, (k, f) in enumerate(events) if k == kind and f is flight)

    launched = [f for kind, f in events if kind == "launch"]
    assert len(launched) > 3
    for i, flight in enumerate(launched[:-1]):
        # the commit of step i comes after the launch of step i + 1
        assert at("commit", flight) > at("launch", launched[i + 1])
