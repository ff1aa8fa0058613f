"""Repetition, frequency and presence penalties, as vLLM and OpenAI define them: before a token is sampled (or
taken greedily), the logits of tokens the request has already produced are lowered.

- repetition_penalty r (> 0; 1 = off): a token in the prompt or the reply so far has its logit divided by r
  when positive, multiplied by r when not (r > 1 discourages it);
- frequency_penalty f and presence_penalty p (in [-2, 2]; 0 = off): logit -= f * count + p * (count > 0),
  count = the token's occurrences in the reply so far.
- logit_bias: a fixed amount (in [-100, 100]) added to given tokens' logits, as OpenAI's `logit_bias`;
- min_tokens: EOS and the stop token ids are masked before that many tokens are generated (vLLM's).
Repetition is applied first, then the other two, then the bias, then temperature and the filters
(sampling.py).

"The reply so far" for the t-th generated token is tokens 0..t-1 of the generation. The host knows them all
except, in a pipelined step, the one the step in flight is sampling. That token is the scored row's own input
(batch.py's anchor), so it is read on the device from the step's input ids: nothing waits for the step in
flight, and a request's tokens are the same alone, batched, pipelined or preempted and recomputed.
Penalised requests never draft (SamplingParams.drafts): a verification would score each draft position under
counts that include the drafts before it, which the rejection step does not model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from .sampling import SamplingParams


@dataclass
class PenaltyRows:
    """The penalised rows of a step's logits and what each has seen."""

    rows: list[int]  # rows of the logits
    params: list[SamplingParams]
    history: list[list[int]]  # the generated tokens the host knows, per row
    pending: mx.array | None  # [P] int32: the token the step in flight samples before this one, -1 where none
    prompt: list[tuple[int, ...]]  # distinct prompt tokens, per row (empty without a repetition penalty)
    blocked: list[tuple[int, ...]] = ()  # tokens masked at this position, per row (min_tokens)


def penalty_rows(sampling, input_ids: mx.array, logits_rows: mx.array | None, eos=()) -> PenaltyRows | None:
    """The step's sampling sequences (scheduler.ScheduledSeq, one per logits row) -> their penalty inputs; None
    when no row is penalised. input_ids / logits_rows: the packed step's (batch.PackedBatch); eos: the ids that
    end a reply, held back by min_tokens."""
    rows = [r for r, s in enumerate(sampling) if s.seq.params.penalized]
    if not rows:
        return None
    history, missing, prompt = [], [], []
    for r in rows:
        seq, t = sampling[r].seq, sampling[r].sample_index
        known = seq.generated[:t]
        history.append(known)
        missing.append(t - len(known))  # 1: token t - 1 is in flight, the input of this row
        prompt.append(seq.prompt_vocab() if seq.params.repetition_penalty != 1 else ())
    if any(m not in (0, 1) for m in missing):
        raise AssertionError(f"penalties: {max(missing)} generated tokens unknown at sampling")
    pending = None
    if any(missing):
        at = logits_rows[mx.array(rows, dtype=mx.int32)]
        pending = mx.where(mx.array(missing, dtype=mx.bool_), input_ids[at], -1)
    params = [sampling[r].seq.params for r in rows]
    blocked = [tuple(sorted({*eos, *p.stop_token_ids})) if sampling[r].sample_index < p.min_tokens else ()
               for r, p in zip(rows, params)]
    return PenaltyRows(rows, params, history, pending, prompt, blocked)


def _counts(history: list[list[int]], pending: mx.array | None, V: int) -> mx.array:
    """[P, V] fp32 occurrences of each token in each row's reply so far."""
    P = len(history)
    counts = mx.zeros((P * V,), dtype=mx.float32)
    flat = [r * V + t for r, h in enumerate(history) for t in h]
    if flat:
        counts = counts.at[mx.array(flat, dtype=mx.int32)].add(1.0)
    if pending is not None:
        idx = mx.arange(P, dtype=mx.int32) * V + mx.maximum(pending, 0)
        counts = counts.at[idx].add((pending >= 0).astype(mx.float32))
    return counts.reshape(P, V)


def penalized(x: mx.array, pen: PenaltyRows) -> mx.array:
    """x [P, V] the penalised rows' logits -> the same, penalised, fp32."""
    P, V = x.shape
    x = x.astype(mx.float32)
    counts = _counts(pen.history, pen.pending, V)
    seen = counts > 0
    rep = [p.repetition_penalty for p in pen.params]
    if any(r != 1 for r in rep):
        flat = [r * V + t for r, ids in enumerate(pen.prompt) for t in ids]
        if flat:
            in_prompt = mx.zeros((P * V,), dtype=mx.float32).at[mx.array(flat, dtype=mx.int32)].add(1.0)
            hit = seen | (in_prompt.reshape(P, V) > 0)
        else:
            hit = seen
        r = mx.array(rep, dtype=mx.float32)[:, None]
        x = mx.where(hit, mx.where(x > 0, x / r, x * r), x)
    freq = mx.array([p.frequency_penalty for p in pen.params], dtype=mx.float32)[:, None]
    pres = mx.array([p.presence_penalty for p in pen.params], dtype=mx.float32)[:, None]
    x = x - freq * counts - pres * seen.astype(mx.float32)
    biased = [(r * V + t, b) for r, p in enumerate(pen.params) for t, b in p.logit_bias]
    if biased:
        bias = mx.zeros((P * V,), dtype=mx.float32).at[mx.array([i for i, _ in biased], dtype=mx.int32)].add(
            mx.array([b for _, b in biased], dtype=mx.float32))
        x = x + bias.reshape(P, V)
    held = [r * V + t for r, ids in enumerate(pen.blocked) for t in ids if t < V]
    if held:
        hold = mx.zeros((P * V,), dtype=mx.float32).at[mx.array(held, dtype=mx.int32)].add(1.0)
        x = mx.where(hold.reshape(P, V) > 0, -mx.inf, x)
    return x


def apply_penalties(logits: mx.array, pen: PenaltyRows | None) -> mx.array:
    """logits [R, V] -> the same with the penalised rows penalised (fp32 when any row is)."""
    if pen is None:
        return logits
    rows = mx.array(pen.rows, dtype=mx.int32)
    out = logits.astype(mx.float32)
    out[rows] = penalized(logits[rows], pen)
    return out
