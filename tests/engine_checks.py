"""Checks shared by the engine, prefix-cache and speculative tests: the single-sequence reference
rule, the idle-engine invariants, a sequence's drafter context, and a driver that submits requests at
given steps."""

from __future__ import annotations

import numpy as np

import mlx.core as mx
from mtlqwen import SeqLayout
from mtlqwen.model.dflash import DrafterCache
from mtlqwen.runtime import SamplingParams

EOS = (508, 510)  # the tiny checkpoints' eos ids (tests/hf_checkpoints.py)


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def near_tie() -> float:
    """Logit gap (x the row's largest magnitude) under which two greedy paths may pick different tokens: fp32
    summation order on the CPU; on a GPU, whose fp32 matmuls may run in TF32 (~1e-3 relative per product,
    compounded over the layers: seen on the H200), 1%."""
    return 1e-4 if on_cpu() else 1e-2


def close(got, want) -> bool:
    """fp32 agreement of two computations of one value: exact up to summation order on the CPU (2e-5); on a GPU
    1% of the largest magnitude, as differently shaped matmuls may run in TF32 there. A wrong row or position
    differs by O(1)."""
    got, want = np.asarray(got), np.asarray(want)
    if on_cpu():
        return np.allclose(got, want, atol=2e-5)
    return float(np.max(np.abs(got - want))) <= 1e-2 * max(float(np.max(np.abs(want))), 1e-6)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def ref_logits(model, ids) -> np.ndarray:
    return np.array(model.logits(ids).astype(mx.float32))


def assert_reference(model, prompt, out, max_tokens: int | None = None, ignore_eos: bool = False):
    """Each generated token is the argmax of the model run alone on prompt + the tokens before it
    (teacher forcing), or within near_tie() x logit scale of it. With max_tokens, the completion
    also ends where it should (at an EOS, or after max_tokens; with ignore_eos only after max_tokens)."""
    toks = out.token_ids
    assert out.error is None and toks, out
    rows = ref_logits(model, prompt + toks[:-1])[len(prompt) - 1 :]
    for k, (tok, row) in enumerate(zip(toks, rows)):
        ref = int(row.argmax())
        if tok != ref:
            gap = row[ref] - row[tok]
            assert gap <= near_tie() * np.abs(row).max(), f"token {k}: engine {tok}, alone {ref} (gap {gap:.3g})"
    if max_tokens is None:
        return
    if not ignore_eos and any(t in EOS for t in toks):
        assert toks.index(next(t for t in toks if t in EOS)) == len(toks) - 1 and out.finish_reason == "stop"
    else:
        assert len(toks) == max_tokens and out.finish_reason == "length"


def assert_idle(eng):
    """Everything the sequences and the prefix cache held is back: blocks, ref counts, slots, snapshots."""
    eng.clear_prefix_cache()  # entries hold bundle references by design; everything else must be free
    s = eng.stats()
    assert s["prefix_entries"] == s["prefix_bytes"] == 0
    assert s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == 0
    assert s["free_slots"] == eng.slots and not eng.has_work()
    assert all(r == 0 for r in eng.pool.ref_counts)
    assert all(q.restore is None for q in eng.scheduler.running)


def run_arrivals(eng, requests, max_steps: int = 20_000):
    """requests: (arrival step, prompt, SamplingParams). Returns the outputs in request order."""
    outs, ids, step = {}, {}, 0
    while len(outs) < len(requests):
        for i, (arrive, prompt, sp) in enumerate(requests):
            if arrive == step:
                ids[eng.submit(prompt, sp)] = i
        for d in eng.step():
            if d.finished:
                outs[ids[d.request_id]] = d.output
        step += 1
        assert step < max_steps
    return [outs[i] for i in range(len(requests))]


def run_preempting(model, params: list, lens: tuple, seed: int, spread: int, num_blocks: int):
    """Requests of random prompts of `lens` tokens cycling through `params`, arriving over `spread` steps, on a
    4-slot engine whose pool of num_blocks 16-token blocks makes it preempt (checked). Returns (requests
    as (arrival, prompt, params), outputs)."""
    from hf_checkpoints import random_token_ids  # noqa: PLC0415
    from mtlqwen.runtime import Engine  # noqa: PLC0415

    reqs = [(k % spread, random_token_ids(n, 512, seed=seed + k), params[k % len(params)]) for k, n in enumerate(lens)]
    eng = Engine(model, slots=4, step_tokens=32, block_tokens=16, num_blocks=num_blocks, prefix_interval=0)
    outs = run_arrivals(eng, reqs)
    assert eng.stats()["preemptions"] > 0
    assert_idle(eng)
    return reqs, outs


def in_flight_verifications(eng):
    """Step `eng` until it has no work; after each step whose launch verified drafts, yield that
    verification (its sequences and stash) while it is still in flight, before its commit."""
    while eng.has_work():
        eng.step()
        fl = eng._inflight
        if fl is not None and fl.spec is not None:
            yield fl.spec


def assert_drafter_context(eng, seq, P, model, drafter, zero_from=None):
    """seq's drafter rows for positions < P equal the one-shot projection of its tokens' taps; rows from
    zero_from to the end of its blocks are zero (never written), when given."""
    bt, nb = eng.block_tokens, len(seq.block_table)
    table = list(range(nb))
    ref = model.make_cache(nb, 1, bt)
    dref = DrafterCache.like(drafter.config, ref)
    lay = SeqLayout([0, P], [0], [table], [0], bt)
    _, taps = model.forward_with_taps(mx.array(seq.tokens[:P], dtype=mx.int32), lay, ref, drafter.tap_layers,
                                      mx.array([], dtype=mx.int32))
    drafter.write_context(taps, lay, dref)
    for got, want in zip(eng.spec.dcache.arrays(), dref.arrays()):
        g = np.array(got[mx.array(seq.block_table)]).reshape(-1, *got.shape[2:])
        w = np.array(want).reshape(-1, *want.shape[2:])
        if on_cpu():
            np.testing.assert_allclose(g[:P], w[:P], rtol=1e-4, atol=1e-4)
        else:  # the one-shot projection and the engine's writes run matmuls of other row counts (TF32)
            assert close(g[:P], w[:P]), float(np.max(np.abs(g[:P] - w[:P])))
        assert zero_from is None or not g[zero_from:].any()


def run_checking_drafter_context(eng, model, drafter, each=None) -> tuple[dict, int]:
    """Step eng until it has no work; after each step whose verification (of one sequence) is in flight,
    check that sequence's drafter context up to its anchor (assert_drafter_context); each(eng) after every
    step, when given. Returns (the finished outputs by request id, the verifications checked)."""
    outs, checked = {}, 0
    while eng.has_work():
        outs.update({d.request_id: d.output for d in eng.step() if d.finished})
        if each is not None:
            each(eng)
        fl = eng._inflight
        if fl is not None and fl.spec is not None:
            (s,) = fl.spec.seqs
            assert_drafter_context(eng, s.seq, s.start, model, drafter)
            checked += 1
    return outs, checked
