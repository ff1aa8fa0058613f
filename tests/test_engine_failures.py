"""A step that fails (sampler, forward, speculative verification; while it is built or while it is
evaluated) fails the requests it computes with the reason, and the engine goes on: a request waiting in
the queue and the next request complete with the tokens they get alone, and nothing leaks.

The outcome, exactly: a sampler error that one request's row raises on its own fails that request alone
(its batch-mates complete correctly). Any other error fails every request the failing step computes
(finish_reason "error", `error` names the exception; each keeps the tokens read back before it); when the
evaluation failed, every running request does too (the device state is undefined then). Requests still
waiting are not touched."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mtlqwen.runtime.sampling as sampling_mod
import mtlqwen.runtime.speculative as spec_mod
from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, assert_reference, greedy
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams

BAD_SEED = 666
ENGINE = dict(slots=2, step_tokens=32, block_tokens=16, num_blocks=16, prefix_interval=8)


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt), model)


def device_failure() -> mx.array:
    """A lazy scalar 0 whose evaluation raises (LU factorisation of a singular matrix, on the CPU)."""
    return mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu).sum() * 0


def alone(model, prompt, sp, **kw) -> list[int]:
    return Engine(model, **{**ENGINE, **kw}).generate([prompt], sp)[0].token_ids


def snapshot(eng):
    s = eng.stats()
    return s["free_blocks"], s["free_slots"], list(eng.pool.ref_counts)


def check_served_on(model, eng, initial, **kw):
    """The engine holds nothing of the failed requests, and the next request gets what it gets alone."""
    assert eng._inflight is None or eng._inflight.spec is None  # no verification (nor its stash) outlives them
    nxt = random_token_ids(21, 512, seed=77)
    (out,) = eng.generate([nxt], greedy(7))
    assert out.finish_reason in ("length", "stop") and out.token_ids == alone(model, nxt, greedy(7), **kw)
    assert_reference(model, nxt, out, 7)
    assert_idle(eng)
    assert snapshot(eng) == initial


def check_failed(out, reason: str, reference: list[int]):
    assert out.finish_reason == "error" and reason in out.error and out.error.startswith("generation failed")
    assert out.token_ids == reference[: len(out.token_ids)]  # what was read back before the failure is right


@pytest.mark.parametrize("speculative", [False, True])
def test_a_sampler_error_fails_its_request_alone_and_the_engine_serves_on(model, drafter, monkeypatch, speculative):
    """The sampler raises for one request's row (as a hostile top_k once did inside MLX): rows are sampled
    on their own to find it, that request fails with the reason, and the bystander sampled in the same step
    and the request waiting for a slot complete with the tokens they get alone."""
    real = sampling_mod.sample

    def faulty(logits, params, seeds, indices):
        if any(p.seed == BAD_SEED for p in params):
            raise RuntimeError("std::bad_cast")
        return real(logits, params, seeds, indices)

    kw = dict(draft=drafter, n_draft=2) if speculative else {}
    prompts = [random_token_ids(n, 512, seed=n) for n in (10, 12, 9)]
    sps = [SamplingParams(temperature=1.0, seed=BAD_SEED, max_tokens=5), greedy(5),
           SamplingParams(temperature=0.8, seed=5, max_tokens=4)]
    refs = [alone(model, p, sp, **kw) for p, sp in zip(prompts, sps)]
    monkeypatch.setattr(sampling_mod, "sample", faulty)
    eng = Engine(model, **ENGINE, **kw)
    initial = snapshot(eng)
    outs = eng.generate(prompts, sps)
    assert outs[0].token_ids == []
    check_failed(outs[0], "RuntimeError: std::bad_cast", [])
    assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
    assert [o.token_ids for o in outs[1:]] == refs[1:]
    assert_reference(model, prompts[1], outs[1], 5)
    check_served_on(model, eng, initial, **kw)


def test_a_sampler_error_no_row_has_alone_fails_the_step(model, monkeypatch):
    """When the batch's sampling raises but no row does on its own, the failure cannot be attributed: the
    step's requests fail with the reason, the queued request completes."""
    real = sampling_mod.sample

    def faulty(logits, params, seeds, indices):
        if len(params) > 1:
            raise MemoryError("injected batch failure")
        return real(logits, params, seeds, indices)

    prompts = [random_token_ids(n, 512, seed=30 + n) for n in (10, 12, 9)]
    sps = [greedy(5), SamplingParams(temperature=1.0, seed=3, max_tokens=5), greedy(4)]
    refs = [alone(model, p, sp) for p, sp in zip(prompts, sps)]
    monkeypatch.setattr(sampling_mod, "sample", faulty)
    eng = Engine(model, **ENGINE)
    initial = snapshot(eng)
    outs = eng.generate(prompts, sps)
    for out in outs[:2]:
        assert out.token_ids == []
        check_failed(out, "MemoryError: injected batch failure", [])
    assert outs[2].token_ids == refs[2]
    monkeypatch.setattr(sampling_mod, "sample", real)
    check_served_on(model, eng, initial)


@pytest.mark.parametrize("where", ["build", "device"])
def test_a_forward_error_fails_the_running_requests_and_the_engine_serves_on(model, monkeypatch, where):
    """The third forward (a decode step) fails while it is built, or its evaluation fails. Both running
    requests fail with the reason, keeping the tokens read back before; the queued one completes. After a
    device failure the cache was reset: the next request's tokens prove its contents are sound."""
    real, calls = model.forward, []

    def faulty(ids, layout, cache, *args, **kw):
        calls.append(layout.num_seqs)
        if len(calls) == 3 and where == "build":
            raise ValueError("injected forward failure")
        logits = real(ids, layout, cache, *args, **kw)
        if len(calls) == 3:  # poison a KV pool and the logits: both evaluations raise
            cache.k_pools[0] = cache.k_pools[0] + device_failure().astype(cache.k_pools[0].dtype)
            logits = logits + device_failure()
        return logits

    monkeypatch.setattr(model, "forward", faulty)
    eng = Engine(model, **ENGINE)
    initial = snapshot(eng)
    prompts = [random_token_ids(n, 512, seed=20 + n) for n in (10, 12, 9)]
    sps = [greedy(6), greedy(6), greedy(4)]
    monkeypatch.setattr(model, "forward", real)
    refs = [alone(model, p, sp) for p, sp in zip(prompts, sps)]
    monkeypatch.setattr(model, "forward", faulty)
    outs = eng.generate(prompts, sps)
    reason = "ValueError: injected forward failure" if where == "build" else "LU factorization failed"
    for out, ref in zip(outs[:2], refs):
        check_failed(out, reason, ref)
        assert 0 < len(out.token_ids) < 6
    assert outs[2].token_ids == refs[2]
    monkeypatch.setattr(model, "forward", real)
    check_served_on(model, eng, initial)


@pytest.mark.parametrize("where", ["build", "device"])
def test_a_verification_error_fails_its_requests_and_the_engine_serves_on(model, drafter, monkeypatch, where):
    """Speculative verification fails (raises while the step is built, or its accepted counts fail to
    evaluate): the verifying requests fail with the reason, the queued one and the next one complete with
    the tokens they get alone with the drafter; stash, drafter context and blocks are all released."""
    real, calls = spec_mod.verify, []

    def faulty(*args):
        calls.append(1)
        if len(calls) == 2 and where == "build":
            raise RuntimeError("injected verification failure")
        k, tok = real(*args)
        return (k + device_failure().astype(k.dtype), tok) if len(calls) == 2 else (k, tok)

    kw = dict(draft=drafter, n_draft=3)
    prompts = [random_token_ids(n, 512, seed=40 + n) for n in (10, 12, 9)]
    sps = [greedy(8), greedy(8), greedy(5)]
    refs = [alone(model, p, sp, **kw) for p, sp in zip(prompts, sps)]
    monkeypatch.setattr(spec_mod, "verify", faulty)
    eng = Engine(model, **ENGINE, **kw)
    initial = snapshot(eng)
    outs = eng.generate(prompts, sps)
    assert len(calls) >= 2
    reason = "RuntimeError: injected verification failure" if where == "build" else "LU factorization failed"
    for out, ref in zip(outs[:2], refs):
        check_failed(out, reason, ref)
    assert outs[2].token_ids == refs[2]
    monkeypatch.setattr(spec_mod, "verify", real)
    check_served_on(model, eng, initial, **kw)


def test_an_error_applying_one_requests_tokens_fails_that_request_alone(model):
    """A detokenizer that raises for one request's token: that request fails, its batch-mate completes."""

    class Tok:
        eos_token_ids = []

        def encode(self, text):
            return [int(t) for t in text.split()]

        def detokenizer(self):
            return Stream()

    class Stream:
        def add(self, i):
            if i == bad[0]:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return f"<{i}>"

        def finish(self):
            return ""

    prompts = [random_token_ids(n, 512, seed=60 + n) for n in (10, 12)]
    refs = [alone(model, p, greedy(5)) for p in prompts]
    bad = [refs[0][2]]
    assert bad[0] not in refs[1]
    eng = Engine(model, **ENGINE, tokenizer=Tok())
    initial = snapshot(eng)
    outs = eng.generate(prompts, greedy(5))
    check_failed(outs[0], "UnicodeDecodeError", refs[0])
    assert outs[0].token_ids == refs[0][:3]
    assert outs[1].finish_reason == "length" and outs[1].token_ids == refs[1]
    bad[0] = -1
    check_served_on(model, eng, initial)
