"""A quantized DFlash drafter (Engine(draft_bits=8 | 4), --draft-bits): quantize_drafter builds the same
drafter as quantizing at load; on a seeded random checkpoint its draft logits stay within a stated relative
error of the float drafter's and its greedy drafts mostly agree; an engine drafting with it keeps plain
decoding's greedy tokens."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest

from engine_checks import assert_idle, greedy
from hf_checkpoints import random_token_ids
from mtlqwen import SeqLayout
from mtlqwen.model.dflash import load_drafter, quantize_drafter
from mtlqwen.runtime import Engine
from test_speculative import draft_dir, drafter, plain_outputs  # noqa: F401

# Measured on this checkpoint (3 contexts x 4 sequences x 8 drafts): 8-bit rel. error 0.007, argmax
# agreement 0.99; 4-bit 0.13 and 0.75 (a random drafter's logits are flat, so ties flip easily).
TOLERANCE = {8: (0.02, 0.9), 4: (0.2, 0.6)}  # bits: (max relative L2 error of the logits, min argmax agreement)


def draft_logits_over_contexts(model, drafters, n: int = 8, S: int = 4, L: int = 40, bt: int = 16):
    """Each drafter's draft logits [3 * S, n, V] after three seeded contexts of S prompts of L tokens."""
    outs = [[] for _ in drafters]
    nb = -(-(L + n + 1) // bt)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(S)]
    for seed in range(3):
        prompts = [random_token_ids(L, 512, seed=seed * 10 + i) for i in range(S)]
        cache = model.make_cache(S * nb, S, bt)
        pre = SeqLayout([i * L for i in range(S + 1)], [0] * S, tables, list(range(S)), bt)
        _, taps = model.forward_with_taps(mx.array(sum(prompts, []), dtype=mx.int32), pre, cache,
                                          drafters[0].tap_layers, mx.array([], dtype=mx.int32))
        dec = SeqLayout(list(range(S + 1)), [L] * S, tables, list(range(S)), bt)
        for out, d in zip(outs, drafters):
            dc = d.make_cache(cache)
            d.write_context(taps, pre, dc)
            out.append(np.array(d.draft_logits([p[-1] for p in prompts], dec, dc, n).astype(mx.float32)))
    return [np.concatenate(o) for o in outs]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_drafts_match_the_float_drafter(model, drafter, draft_dir, bits):
    q = quantize_drafter(drafter, bits)
    assert q.fc.quantized and q.fc.bits == bits and q.ctx_kv.quantized and q.layers[0].q_proj.bits == bits
    assert q.config.quantization.bits == bits and drafter.config.quantization is None  # the original stays float
    assert not drafter.fc.quantized and q.target is drafter.target
    at_load = load_drafter(draft_dir, model, quantize=(bits, 64))
    fp, qd, ld = draft_logits_over_contexts(model, [drafter, q, at_load])
    assert np.array_equal(qd, ld)  # the same quantization as at load
    rel = np.linalg.norm(qd - fp) / np.linalg.norm(fp)
    agree = (qd.argmax(-1) == fp.argmax(-1)).mean()
    max_rel, min_agree = TOLERANCE[bits]
    assert rel <= max_rel and agree >= min_agree, (bits, rel, agree)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_drafter(q, 4)


def test_engine_drafts_with_a_quantized_drafter(model, drafter, draft_dir):
    prompts = [random_token_ids(n, 512, seed=500 + n) for n in (13, 27)]
    sp = greedy(10, ignore_eos=True)
    kw = dict(slots=2, step_tokens=32, block_tokens=16, num_blocks=16)
    base = plain_outputs(model, prompts, sp, **kw)
    for draft, bits in ((drafter, 8), (str(draft_dir), 4)):
        eng = Engine(model, draft=draft, draft_bits=bits, n_draft=3, prefix_interval=0, **kw)
        d = eng.spec.drafter
        assert d is not drafter and d.fc.quantized and d.fc.bits == bits
        assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in base]
        assert eng.stats()["draft_tokens"] > 0
        assert_idle(eng)
    with pytest.raises(ValueError, match="draft_bits needs a drafter"):
        Engine(model, draft_bits=8, **kw)
    # prefix-cache entries carry drafter rows: a quantized drafter's are not the float one's
    roots = {Engine(model, draft=drafter, draft_bits=b, **kw).kv.prefix.root for b in (None, 8, 4)}
    assert len(roots) == 3


def test_server_passes_draft_bits(draft_dir, ckpt):
    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    args = argparse.Namespace(draft=str(draft_dir), draft_bits=4, prefix_interval=None, slots=2, step_tokens=32,
                              prefill_step_tokens=None, block_tokens=16, num_blocks=20, max_model_len=None)
    kw = _engine_kwargs(args)
    assert kw["draft_bits"] == 4
    eng = Engine(str(ckpt), **kw)
    assert eng.spec.drafter.fc.bits == 4 and eng.spec.drafter.source == str(draft_dir)
