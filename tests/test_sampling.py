"""SamplingParams validation and the sampler: greedy, filters, per-request reproducible draws."""

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.runtime.sampling import SamplingParams, sample, token_key


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        # hostile values a client can send (2^63 once reached the sampler and took the engine down)
        ({"temperature": 0.7, "top_k": 2**63}, "top_k"),
        ({"temperature": 0.7, "top_k": 10**30}, "top_k"),
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": 0.0099}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vocabulary_bounds():
    p = SamplingParams(temperature=0.7, top_k=100, stop_token_ids=(99,))
    p.check_vocab(100)
    with pytest.raises(ValueError, match="top_k"):
        p.check_vocab(99)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(100,)).check_vocab(100)
    assert SamplingParams(temperature=0.01).temperature == 0.01  # the floor itself is allowed


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.0, 1.0, 0, 0.0, 256)
    assert p.greedy and not p.filtered and p.stop == () and p.seed is None and not p.ignore_eos
    q = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert q.stop == ("END",) and q.stop_token_ids == (3, 4)
    assert dataclasses.replace(q, temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(q, temperature=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.max_tokens = 3


def _logits(rows, vocab=64, seed=0):
    return mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 3


def test_greedy_is_argmax():
    x = _logits(5)
    out = sample(x, [SamplingParams()] * 5, [0] * 5, [0] * 5)
    assert out.dtype == mx.int32
    assert out.tolist() == mx.argmax(x, axis=-1).tolist()


def test_draws_depend_only_on_seed_and_token_index():
    x = _logits(1)
    hot = SamplingParams(temperature=1.0)
    alone = sample(x, [hot], [42], [3]).item()
    # same row among other rows, greedy and sampled, at another batch position
    batch = mx.concatenate([_logits(2, seed=1), x, _logits(1, seed=2)])
    params = [hot, SamplingParams(), hot, hot]
    assert sample(batch, params, [1, 0, 42, 9], [0, 0, 3, 3]).tolist()[2] == alone
    draws = {sample(x, [hot], [42], [i]).item() for i in range(30)}
    assert len(draws) > 3  # the token index changes the key
    assert token_key(42, 3).tolist() == token_key(42, 3).tolist() != token_key(42, 4).tolist()
    assert token_key(42, 3).tolist() != token_key(43, 3).tolist()


def _draw_many(logits_row, params, n=300):
    x = mx.broadcast_to(logits_row, (n, logits_row.shape[-1]))
    return sample(x, [params] * n, list(range(n)), [0] * n).tolist()


def test_filters_keep_exactly_the_allowed_tokens():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = mx.array(np.log(probs), dtype=mx.float32)
    # top_p 0.8: 0.5 + 0.3 reaches it, so {0, 1}; top_p 0.81 needs the third token
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_p=0.8))) == {0, 1}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_p=0.81))) == {0, 1, 2}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_k=3))) == {0, 1, 2}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_k=1))) == {0}
    # min_p 0.29: p >= 0.145 keeps {0, 1, 2}; 0.61 keeps p >= 0.305: {0}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, min_p=0.29))) == {0, 1, 2}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, min_p=0.61))) == {0}
    # top_k first, then top_p over the renormalised survivors: top_k=2 -> (0.625, 0.375)
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))) == {0}
    assert set(_draw_many(row, SamplingParams(temperature=1.0))) == {0, 1, 2, 3}
    # edges: a top_p that is 0 in fp32 still keeps the most likely token; top_k past the row is no filter
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_p=1e-300))) == {0}
    assert set(_draw_many(row, SamplingParams(temperature=1.0, top_k=1000))) == {0, 1, 2, 3}


def test_sample_frequencies_follow_the_softmax():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = mx.array(np.log(probs) * 2.0, dtype=mx.float32)  # temperature 2 undoes the scaling
    n = 1200
    counts = np.bincount(_draw_many(row, SamplingParams(temperature=2.0), n), minlength=4)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 for 3 degrees of freedom


def test_mixed_rows_greedy_untouched():
    x = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(), SamplingParams(temperature=1.3)]
    out = sample(x, params, [1, 2, 3, 4], [0, 0, 0, 0]).tolist()
    am = mx.argmax(x, axis=-1).tolist()
    assert out[0] == am[0] and out[2] == am[2]
    top5 = set(np.argsort(-np.array(x[1]))[:5].tolist())
    assert out[1] in top5
    assert all(0 <= t < 64 for t in out) and not math.isnan(out[3])
