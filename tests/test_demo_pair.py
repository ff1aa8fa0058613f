"""The built-in models: `--model random` and the trained demo pair shipped in mtlqwen/demo/pair (or the
pair at $MTLQWEN_DEMO_PAIR). The pair's held-out loss must match the value recorded when it was installed
(training/export_demo.py), and its drafter must get drafts accepted on held-out text while leaving greedy
output unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtlqwen import Engine, SamplingParams
from mtlqwen.demo import PAIR_DIR, DemoPairMissing, heldout_loss, load_demo_pair, pair_dir
from mtlqwen.demo import is_builtin, load_builtin
from mtlqwen.kernels import use_kernels
from mtlqwen.model.builtin import BYTE_VOCAB, ByteTokenizer

PAIR = Path(os.environ.get("MTLQWEN_DEMO_PAIR", PAIR_DIR))
PACKAGE_BUDGET = 25 * 10**6  # bytes: the pair ships inside the wheel


def test_random_builtin():
    b = load_builtin("random")
    assert isinstance(b.tokenizer, ByteTokenizer) and b.drafter is None
    assert b.model.config.vocab_size == BYTE_VOCAB and "RANDOM" in b.note
    assert is_builtin(None) and is_builtin("random") and not is_builtin("Qwen/Qwen3.5-9B")
    with pytest.raises(ValueError, match="not a built-in model"):
        load_builtin("Qwen/Qwen3.5-9B")


def test_missing_pair_falls_back_to_random(tmp_path):
    with pytest.raises(DemoPairMissing, match=r"missing target/config.json, drafter/config.json, demo.json"):
        pair_dir(tmp_path)
    b = load_builtin(None, pair_path=tmp_path)
    assert isinstance(b.tokenizer, ByteTokenizer) and b.drafter is None
    assert "no trained demo pair" in b.note and "RANDOM" in b.note


@pytest.fixture(scope="module")
def pair():
    try:
        pair_dir(PAIR)
    except DemoPairMissing as e:
        pytest.skip(f"demo pair not installed: {e}")
    return load_demo_pair(PAIR)


def test_heldout_loss_matches_record(pair):
    ids = pair.tokenizer.encode(pair.heldout_text)
    loss, n = heldout_loss(pair.model, ids)
    assert n == pair.record["heldout_tokens"]
    # the recorded value came from the same weights; backends differ only in rounding
    assert loss == pytest.approx(pair.record["heldout_loss"], rel=5e-3)


def test_drafter_accepts_on_heldout_text_and_keeps_greedy_output(pair):
    tok = pair.tokenizer
    prompt = tok.encode(pair.heldout_text)[:96]
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    plain = Engine(pair.model, tokenizer=tok, slots=1).generate([prompt], sp)[0]
    engine = Engine(pair.model, tokenizer=tok, slots=1, draft=pair.drafter, draft_policy="fixed")  # drafts every step
    spec = engine.generate([prompt], sp)[0]
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 0
    stats = engine.spec.stats()
    assert engine.spec.n_draft == 3  # the pair's own default draft length (mtlqwen.demo.DEMO_N_DRAFT)
    assert stats["spec_steps"] > 0
    assert stats["mean_acceptance_length"] > 1.2  # tokens per speculative step: drafts do get accepted


def test_builtin_default_is_the_pair(pair):
    if PAIR != PAIR_DIR:
        pytest.skip("MTLQWEN_DEMO_PAIR points elsewhere; the package default is the packaged pair")
    b = load_builtin(None)
    assert b.drafter is not None and b.tokenizer.eos_token_ids == pair.tokenizer.eos_token_ids
    size = sum(p.stat().st_size for p in PAIR_DIR.rglob("*") if p.is_file())
    assert size <= PACKAGE_BUDGET


def _heldout_prompts(pair, lengths=(40, 75, 130, 200)) -> list[list[int]]:
    """Prompts cut from held-out files at different places (never trained on); the last two share a
    prefix of 130 tokens, so the second can hit the first's snapshot and turn entries."""
    ids = pair.tokenizer.encode(pair.heldout_text)
    return [ids[300 : 300 + lengths[0]], ids[900 : 900 + lengths[1]], ids[:lengths[2]], ids[:lengths[3]]]


@pytest.fixture(scope="module")
def pair32(pair):
    return load_demo_pair(PAIR, fp32=True)


def test_greedy_continuations_equal_across_schedules(pair32):
    """Whole greedy continuations of a trained model (no near-ties to excuse: fp32, where bf16's rounding
    step would tie logits every few hundred tokens) are the same token for token whether a request runs
    alone or batched, its prompt whole or in 16-token chunks, after a prefix hit or speculating."""
    pair = pair32
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = _heldout_prompts(pair)
    alone = [Engine(pair.model, tokenizer=pair.tokenizer, slots=1, prefix_interval=0).generate([p], sp)[0].token_ids
             for p in prompts]
    schedules = {
        "batched, 16-token chunks": dict(slots=4, step_tokens=16, prefill_step_tokens=16, prefix_interval=0),
        "prefix hits": dict(slots=2, prefix_interval=32),
        "speculating, batched": dict(slots=4, draft=pair.drafter, n_draft=7, prefix_interval=0),
    }
    for name, kw in schedules.items():
        engine = Engine(pair.model, tokenizer=pair.tokenizer, **kw)
        outs = engine.generate(prompts, sp)
        if name == "prefix hits":  # the same prompts again: now every one restores a cached state
            hits0 = engine.stats()["prefix_hits"]
            outs = engine.generate(prompts, sp)
            assert engine.stats()["prefix_hits"] >= hits0 + len(prompts)
        assert [o.token_ids for o in outs] == alone, name
        assert all(len(t) == 40 for t in alone)


@pytest.mark.gpu
@pytest.mark.skipif(not use_kernels(), reason="GPU-only: the compiled speculative path runs where the kernels run (CPU: the test above)")
def test_gpu_compiled_speculation_keeps_greedy_output_at_1_4_8(pair32):
    """On the GPU kernels the engine compiles decode, verification, the drafter pass and the commit by default:
    whole greedy continuations with the drafter (fixed policy, every eligible step speculates) equal those
    without it at 1, 4 and 8 concurrent sequences (fp32: no rounding ties to excuse), synchronous and with
    each all-verify step launched while the previous one is in flight (spec_pipeline)."""
    pair = pair32
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    ids = pair.tokenizer.encode(pair.heldout_text)
    prompts = _heldout_prompts(pair) + [ids[450 + 260 * i : 450 + 260 * i + 50 + 9 * i] for i in range(4)]
    plain = [o.token_ids for o in Engine(pair.model, tokenizer=pair.tokenizer, slots=8, prefix_interval=0)
             .generate(prompts, sp)]
    for slots, pipelined in [(n, p) for n in (1, 4, 8) for p in (False, True)]:
        engine = Engine(pair.model, tokenizer=pair.tokenizer, slots=slots, draft=pair.drafter, n_draft=7,
                        draft_policy="fixed", prefix_interval=0, spec_pipeline=pipelined)
        assert engine.compiled is not None  # the default where the kernels run
        outs = engine.generate(prompts, sp)
        assert [o.token_ids for o in outs] == plain, f"{slots} slots, pipelined {pipelined}"
        st = engine.stats()
        assert st["spec_steps"] > 0 and st["mean_acceptance_length"] > 1.2
        assert (st.get("spec_pipelined_steps", 0) > 0) == pipelined
        assert engine.pool.num_free == engine.pool.num_blocks  # nothing leaked
