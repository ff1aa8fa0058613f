"""The pipelined speculative step (Engine(spec_pipeline=True), runtime/spec_pipeline.py) on the tiny random
target and drafter (CPU, compiled traces): greedy outputs equal the synchronous engine's and plain
decoding's under random acceptance, max_tokens / a stop token / a cancel mid-run, at 1, 3, 4 and 8 sequences;
pipelined steps are counted; nothing leaks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, assert_reference, greedy, run_arrivals
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, EngineConfig
from mtlqwen.runtime.block_pool import BlockPool
from test_speculative import spec_workloads


@pytest.fixture(scope="module")
def drafter(ckpt, tmp_path_factory, model):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2, block_size=16),
                        model)


class PositionOracle:
    """Proposes each request's plain greedy continuation, the token at position p replaced by a wrong one
    where a fixed random mask (by prompt and position, never by step) says so. Drafts are gathered on the
    device by the anchor positions, so the synchronous hook (host kv_valid) and the pipelined one (device
    kv_valid) propose the same drafts for the same anchor, and every acceptance pattern is reproducible."""

    def __init__(self, ref: dict, noise: float, seed: int = 0, vocab: int = 500, length: int = 160):
        rng = np.random.default_rng(seed)
        self.rows: dict[tuple, mx.array] = {}
        for prompt, full in ref.items():
            toks = np.array(list(full) + [0] * (length - len(full)), dtype=np.int64)
            bad = rng.random(len(toks)) < noise
            toks[bad] = (toks[bad] + 1 + rng.integers(0, vocab - 1, int(bad.sum()))) % vocab
            self.rows[tuple(prompt)] = mx.array(toks, dtype=mx.int32)
        self.calls = {"host": 0, "device": 0}

    def _drafts(self, seqs, starts: mx.array, n: int) -> mx.array:
        table = mx.stack([self.rows[tuple(s.seq.tokens[: s.seq.prompt_len])] for s in seqs])  # [S, L]
        at = mx.minimum(starts[:, None] + 1 + mx.arange(n, dtype=mx.int32)[None, :], table.shape[1] - 1)
        return mx.take_along_axis(table, at, axis=1)

    def host(self, seqs, layout, n):
        self.calls["host"] += 1
        return self._drafts(seqs, mx.array(layout.kv_valid, dtype=mx.int32), n), None

    def device(self, seqs, anchors, layout, n):
        self.calls["device"] += 1
        return self._drafts(seqs, layout.array("kv_valid"), n)


KW = dict(step_tokens=64, block_tokens=8, prefix_interval=0, n_draft=3)


def engine(model, drafter, ref, noise, pipeline, slots, seed=0, **kw):
    cfg = {**KW, "verify_commit": "candidates", **kw}
    eng = Engine(model, slots=slots, num_blocks=cfg.pop("num_blocks", 48), draft=drafter, compile_decode=True,
                 spec_pipeline=pipeline, **cfg)
    oracle = PositionOracle(ref, noise, seed)
    eng.spec.propose, eng.spec.propose_on_device = oracle.host, oracle.device
    return eng, oracle


def run(eng, prompts, sps):
    """Step to the end; the outputs in request order."""
    ids = [eng.submit(p, sp) for p, sp in zip(prompts, sps)]
    outs, step = {}, 0
    while eng.has_work():
        for d in eng.step():
            if d.finished:
                outs[d.request_id] = d.output
        step += 1
        assert step < 2000
    return [outs[i] for i in ids]


def plain(model, prompts, sps, slots):
    return Engine(model, slots=slots, num_blocks=48, **{k: v for k, v in KW.items() if k != "n_draft"}).generate(prompts, sps)


@pytest.mark.parametrize("slots", [1, 3, 4, 8])
@pytest.mark.parametrize("noise", [0.0, 0.35])
def test_pipelined_equals_synchronous_and_plain(model, drafter, slots, noise):
    """max_tokens differ per request (each hits its limit mid-run of the others); one request stops on a
    stop token inside a verification's run. Same tokens as plain decoding and as the synchronous engine,
    the same drafts and acceptances (the pipelined step repeats the draft counts the synchronous rule would
    choose), fewer synchronous read-backs; the pool, slots and scheduler are empty afterwards."""
    prompts = [random_token_ids(n, 500, seed=300 + n + slots) for n in (11, 26, 5, 17, 8, 20, 14, 29)][:slots]
    sps = [greedy(mt, ignore_eos=True) for mt in (37, 23, 30, 41, 19, 33, 27, 45)][:slots]
    base = plain(model, prompts, sps, slots)
    if slots > 1:  # a stop token that plain decoding emits mid-run of request 1
        stop = base[1].token_ids[12]
        sps[1] = greedy(23, ignore_eos=True, stop_token_ids=[stop])
        base = plain(model, prompts, sps, slots)
        assert base[1].finish_reason == "stop" and len(base[1].token_ids) < 23
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain(model, prompts,
                                                                    [greedy(60, ignore_eos=True)] * slots, slots))}
    got = {}
    for pipeline in (False, True):
        eng, oracle = engine(model, drafter, ref, noise, pipeline, slots)
        outs = run(eng, prompts, sps)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base], pipeline
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in base]
        got[pipeline] = (eng.stats(), oracle.calls)
        assert_idle(eng)
    (sync, sync_calls), (pipe, pipe_calls) = got[False], got[True]
    assert sync["spec_pipelined_steps"] == 0 and sync_calls["device"] == 0
    assert pipe["spec_pipelined_steps"] == pipe_calls["device"] > 0
    assert pipe["generated_tokens"] == sync["generated_tokens"]
    if slots == 1:  # no stop: not one verification is dropped, so the counts are the synchronous ones
        for key in ("draft_tokens", "accepted_tokens", "spec_verifications", "spec_steps", "steps"):
            assert pipe[key] == sync[key], key
    # every pipelined step replaces a verification the synchronous engine launched after a read-back
    assert pipe_calls["host"] + pipe_calls["device"] >= sync_calls["host"]
    assert pipe_calls["host"] < sync_calls["host"]


@pytest.mark.parametrize("slots", [1, 3, 4])
def test_cancel_and_eos_mid_pipeline(model, drafter, slots):
    """Two requests end on EOS mid-run (not ignored) as plain decoding does, their last pipelined step
    dropped; a third is cancelled while a pipelined step computing it is in flight and ends with a prefix of
    its plain output; the others go on pipelined without it. With one slot the requests queue (the queue
    does not stop the pipeline: nobody could be admitted). Nothing leaks."""
    prompts = [random_token_ids(n, 500, seed=421 + n) for n in (9, 14, 21)]
    sps = [greedy(40)] * 3
    base = plain(model, prompts, sps, slots)
    assert [o.finish_reason for o in base] == ["stop", "stop", "length"]  # EOS after 13 and 35 tokens
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain(model, prompts,
                                                                    [greedy(60, ignore_eos=True)] * 3, slots))}
    eng, _ = engine(model, drafter, ref, 0.2, True, slots, seed=5)
    seen = []
    orig = eng.pipeline.step

    def spy(deltas):
        seen.append(orig(deltas))
        return seen[-1]

    eng.pipeline.step = spy
    ids = [eng.submit(p, sp) for p, sp in zip(prompts, sps)]
    outs, cancelled, steps = {}, None, 0
    while eng.has_work():
        for d in eng.step():
            if d.finished:
                outs[d.request_id] = d.output
        fl, steps = eng._inflight, steps + 1
        if cancelled is None and seen[-1] and any(q.request_id == ids[2] for q in fl.seqs) and steps > 4:
            cancelled = eng.stats()["spec_pipelined_steps"]
            assert eng.cancel(ids[2])
        assert steps < 2000
    outs = [outs[i] for i in ids]
    assert cancelled is not None and outs[2].finish_reason == "cancelled"
    assert base[2].token_ids[: len(outs[2].token_ids)] == outs[2].token_ids
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in base[:2]]
    assert [o.finish_reason for o in outs[:2]] == ["stop", "stop"]
    assert eng.stats()["spec_pipelined_steps"] == sum(seen) > 0
    if slots > 1:  # request 1 went on pipelined after the cancel (the in-flight step's other rows carried)
        assert eng.stats()["spec_pipelined_steps"] > cancelled
    assert_idle(eng)
    (again,) = eng.generate(prompts[2:], sps[2:])  # the engine serves a new request after all that
    assert again.token_ids == base[2].token_ids
    assert_idle(eng)


def test_fallbacks_and_option(model, drafter):
    """Temperature > 0, an uncompiled engine or a replay commit keep the synchronous rule (no pipelined
    step); the option needs a drafter and is a bool, or None: on where the steps are compiled."""
    prompt = random_token_ids(12, 500, seed=9)
    ref = {tuple(prompt): prompt + plain(model, [prompt], [greedy(60, ignore_eos=True)], 1)[0].token_ids}
    for kw, sp in ((dict(), greedy(20, temperature=0.8, seed=3)),
                   (dict(verify_commit="replay"), greedy(20, ignore_eos=True))):
        eng, _ = engine(model, drafter, ref, 0.0, True, 1, **kw)
        if sp.temperature > 0:  # the real drafter: sampled drafts need its logits
            eng.spec.propose = type(eng.spec).propose.__get__(eng.spec)
        eng.generate([prompt], sp)
        s = eng.stats()
        assert s["spec_steps"] > 0 and s["spec_pipelined_steps"] == 0, kw
        assert_idle(eng)
    eng = Engine(model, slots=1, num_blocks=48, draft=drafter, spec_pipeline=True, compile_decode=False, **KW)
    eng.spec.propose = PositionOracle(ref, 0.0).host
    (out,) = eng.generate([prompt], greedy(20, ignore_eos=True))
    assert out.token_ids == ref[tuple(prompt)][12:32] and eng.stats()["spec_pipelined_steps"] == 0
    with pytest.raises(ValueError, match="spec_pipeline needs a drafter"):
        EngineConfig(spec_pipeline=True)
    with pytest.raises(ValueError, match="spec_pipeline must be true or false"):
        EngineConfig(draft="x", spec_pipeline=1)
    # the default (None): pipelined where the steps are compiled, with a drafter only
    assert EngineConfig().spec_pipeline is None
    assert Engine(model, slots=1, num_blocks=48, draft=drafter, compile_decode=True, **KW).pipeline is not None
    assert Engine(model, slots=1, num_blocks=48, draft=drafter, compile_decode=False, **KW).pipeline is None
    assert Engine(model, slots=1, num_blocks=48, compile_decode=True, step_tokens=64, block_tokens=8,
                  prefix_interval=0).pipeline is None


def test_turn_entry_after_a_stop_inside_the_pipeline(model, drafter):
    """With the prefix cache on, a request stops (stop token) at a read-back while its next verification is
    in flight: its slot's state lies past its tokens, so no turn entry may be kept of it; a second turn
    extending the first must still give plain decoding's tokens (a wrong entry would change them)."""
    prompt = random_token_ids(13, 500, seed=77)
    long = plain(model, [prompt], [greedy(60, ignore_eos=True)], 1)[0].token_ids
    ref = {tuple(prompt): prompt + long}
    sp = greedy(40, ignore_eos=True, stop_token_ids=[long[17]])
    (first,) = plain(model, [prompt], [sp], 1)
    assert first.finish_reason == "stop"
    turn2 = prompt + first.token_ids + random_token_ids(6, 500, seed=78)
    (second,) = plain(model, [turn2], [greedy(12, ignore_eos=True)], 1)
    ref[tuple(turn2)] = turn2 + second.token_ids + [0] * 8
    eng, oracle = engine(model, drafter, ref, 0.0, True, 1, prefix_interval=64)
    row, at = oracle.rows[tuple(prompt)], len(prompt) + 17
    row[at] = (row[at] + 1) % 500  # the stop token comes as a correction: the run ends on it, kv_valid too
    (got,) = eng.generate([prompt], sp)
    assert got.token_ids == first.token_ids and eng.stats()["spec_pipelined_steps"] > 0
    (got2,) = eng.generate([turn2], greedy(12, ignore_eos=True))
    assert got2.token_ids == second.token_ids
    assert eng.stats()["prefix_hits"] == 0  # no turn entry of a state past the request's tokens
    assert_idle(eng)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=spec_workloads())
def test_random_workloads_pipelined_match_plain_decoding(model, drafter, w):
    """test_speculative's workloads (staggered arrivals, prefill next to verifications, opted-out requests,
    snapshot intervals, tight pools and preemptions) with spec_pipeline on and position-keyed acceptance:
    plain decoding's tokens (near-ties excepted), nothing leaked."""
    bt = w["block_tokens"]
    requests = [(arr, p, greedy(mt, speculative=spec)) for arr, p, mt, spec in w["reqs"]]
    need = max(BlockPool.blocks_for(len(p) + sp.max_tokens - 1, bt) for _, p, sp in requests)
    kw = dict(slots=w["slots"], step_tokens=w["step_tokens"], block_tokens=bt, num_blocks=need + w["extra_blocks"])
    prompts = [p for _, p, _ in requests]
    base = Engine(model, prefix_interval=0, **kw).generate(prompts, [sp for _, _, sp in requests])
    long = Engine(model, prefix_interval=0, **kw).generate(prompts, [greedy(40, ignore_eos=True)] * len(prompts))
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, long)}
    eng = Engine(model, draft=drafter, n_draft=w["n_draft"], prefix_interval=w["prefix_interval"], compile_decode=True,
                 spec_pipeline=True, **kw)
    oracle = PositionOracle(ref, w["noise"], length=128)
    eng.spec.propose, eng.spec.propose_on_device = oracle.host, oracle.device
    outs = run_arrivals(eng, requests, max_steps=5000)
    for (_, prompt, sp), o, b in zip(requests, outs, base):
        if o.token_ids != b.token_ids:
            assert_reference(model, prompt, o, sp.max_tokens)
    assert eng.stats()["spec_pipelined_steps"] == oracle.calls["device"]
    assert_idle(eng)


def test_a_pipelined_step_that_fails_while_built(model, drafter):
    """The drafter raises while a pipelined step is built: the step in flight is still read back (its
    tokens delivered), then the pipelined step's requests fail with the error and free everything; the
    engine serves the next request."""
    prompts = [random_token_ids(n, 500, seed=500 + n) for n in (10, 19)]
    sps = [greedy(30, ignore_eos=True)] * 2
    base = plain(model, prompts, sps, 2)
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, base)}
    eng, oracle = engine(model, drafter, ref, 0.0, True, 2)

    def broken(*a):
        raise RuntimeError("drafter broke")

    eng.spec.propose_on_device = broken
    outs = run(eng, prompts, sps)
    for o, b in zip(outs, base):
        assert o.finish_reason == "error" and "drafter broke" in o.error
        assert 0 < len(o.token_ids) < 30 and b.token_ids[: len(o.token_ids)] == o.token_ids
    assert eng.stats()["spec_pipelined_steps"] == 0
    assert_idle(eng)
    eng.spec.propose_on_device = oracle.device
    assert [o.token_ids for o in eng.generate(prompts, sps)] == [o.token_ids for o in base]
    assert eng.stats()["spec_pipelined_steps"] > 0
    assert_idle(eng)
