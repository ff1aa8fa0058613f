"""The engine loop: submit requests, step the batch, stream deltas, collect outputs.

One `step()`: schedule (pure Python), pack, launch the model + sampler for the whole batch without
waiting, then read back the *previous* step's tokens and commit them. So the host builds step N+1
while the device runs step N; the only synchronisation is reading sampled tokens. The price is a
one-step lag: a sequence that hits EOS at step N was already sent to step N+1, whose token for it
is dropped (its writes land in blocks and a slot that are freed, and are ordered before any reuse by
MLX's data dependencies through the pool arrays).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..kernels import use_kernels
from ..model.compiled import CompiledDecode
from .admission import as_params, check_request, prompt_ids
from .batch import PackedBatch, pack, token_buckets
from .draft_policy import make_policy
from .config import EngineConfig
from .dense_weights import keep_dense_weights, kept_bytes, resolve as resolve_dense
from .failures import EvalFailed, Failures, reason
from .engine_prefix import PrefixControls
from .generate import Generation
from .measured_costs import StepTimer, decode_shape
from .memory import plan_memory
from .outputs import Delta, Output, TextState
from .kv_manager import KVManager, StepSnapshots
from .prefix_cache import model_identity
from .logprobs import StepLogprobs, prompt_logprobs
from .sampling import SamplingParams, sample_rows
from .structured import Constraints
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .spec_pipeline import SpecPipeline
from .speculative import Speculator, load_draft
from .sequence import Sequence, SeqStatus


@dataclass
class _InFlight:
    seqs: list[Sequence]  # every sequence the step computes: the ones a failure of the step takes down
    sampling: list[ScheduledSeq]
    tokens: mx.array | None  # [R] sampled ids, still on the device
    rows: dict[Sequence, int]  # row of each sampling sequence in `tokens`
    snapshots: StepSnapshots | None = None  # the step's prefix-cache captures, published at read-back
    spec: Any = None  # speculative._Verification: the step's verifying sequences, applied at read-back
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # sampler errors of one request each
    logprobs: StepLogprobs | None = None  # of the sampling rows that asked for them, read back with the tokens
    shape: tuple[int, int, int] | None = None  # a pure decode step's (rows, speculating, drafts): its timing's key


_UNSET: Any = object()  # an Engine keyword left out: EngineConfig's value stands
_OPTIONS = frozenset(f.name for f in fields(EngineConfig))


def _load(model_or_path, tokenizer):
    """(model, tokenizer) from what Engine accepts: a model or a checkpoint path / repo id (its tokenizer.json
    is the default tokenizer), a tokenizer object or path."""
    if isinstance(model_or_path, (str, Path)):
        from ..model import load, resolve_model_path  # noqa: PLC0415

        local = resolve_model_path(model_or_path)  # a repo id is downloaded once, here
        model = load(local)
        if tokenizer is None and (local / "tokenizer.json").is_file():
            tokenizer = local
    else:
        model = model_or_path
    if isinstance(tokenizer, (str, Path)):
        from ..tokenizer import load_tokenizer  # noqa: PLC0415

        tokenizer = load_tokenizer(tokenizer)
    return model, tokenizer


class Engine(Generation, PrefixControls):
    """Batched generation over a fixed number of slots with paged KV memory.

    Options come as keywords or as `config=EngineConfig(...)` (keywords override its fields); config.py's
    EngineConfig says what each one does, and `engine.engine_config` holds the validated result.
    model_or_path: a Qwen35Model or what `mtlqwen.load` accepts. tokenizer: an object with
    encode/decode/detokenizer (or a path for `mtlqwen.load_tokenizer`); when None and the model is a
    checkpoint directory holding tokenizer.json, that tokenizer is loaded. Without a tokenizer prompts
    must be token ids and outputs carry no text.

    Not thread-safe: one thread calls submit/step/cancel (a server feeds it through a queue)."""

    def __init__(
        self,
        model_or_path,
        config: EngineConfig | None = None,
        *,
        tokenizer=None,
        slots: int = _UNSET,
        step_tokens: int = _UNSET,
        prefill_step_tokens: int | None = _UNSET,
        block_tokens: int = _UNSET,
        num_blocks: int | None = _UNSET,
        kv_bytes: int | None = _UNSET,
        max_model_len: int | None = _UNSET,
        pad_buckets: bool = _UNSET,
        seed: int | None = _UNSET,
        prefix_interval: int = _UNSET,
        prefix_cache_bytes: int | None = _UNSET,
        prefix_in_step: bool = _UNSET,
        draft=_UNSET,
        n_draft: int | None = _UNSET,
        compile_decode: bool | None = _UNSET,
        verify_commit: str | None = _UNSET,
        draft_policy=_UNSET,
        draft_costs=_UNSET,
        learn_draft_costs: bool | None = _UNSET,
        draft_bits: int | None = _UNSET,
        spec_pipeline: bool | None = _UNSET,
        dense_weights: bool | None = _UNSET,
    ):
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__} (options go by keyword)")
        given = {k: v for k, v in locals().items() if v is not _UNSET and k in _OPTIONS}
        cfg = self.engine_config = EngineConfig.build(config, **given)  # unset keywords: config's, or the defaults
        model, tokenizer = _load(model_or_path, tokenizer)
        self.model, self.config, self.tokenizer = model, model.config, tokenizer
        ctx = self.config.max_position_embeddings
        self.max_model_len = min(ctx, cfg.max_model_len) if cfg.max_model_len else ctx
        self.block_tokens, self.slots = block_tokens, slots = cfg.block_tokens, cfg.slots
        drafter, n_draft = load_draft(model, cfg.draft, cfg.n_draft, slots, cfg.step_tokens, cfg.draft_bits)
        # before the KV pool is sized from the memory left: the copies take their share first
        keep_dense_weights(model, resolve_dense(model, cfg.dense_weights))
        self.step_tokens = step_tokens = cfg.step_budget(n_draft)  # the default grows so every slot can verify
        mem = plan_memory(self.config, model.dtype, cfg, self.max_model_len,
                          Speculator.bytes_per_block(drafter, block_tokens, model.dtype))  # drafter K/V share the bundles
        self.num_blocks = mem.num_blocks
        drafter_id = getattr(drafter, "source", drafter)
        if drafter is not None and drafter.config.quantization is not None:  # its rows differ from the float one's
            drafter_id = f"{drafter_id}|{drafter.config.quantization}"
        identity = model_identity(model, drafter_id)  # entries carry drafter rows
        self.kv = KVManager(self.num_blocks, block_tokens, cfg.prefix_interval, mem.prefix_bytes, identity,
                            mem.prefix_entry_bytes, cfg.prefix_in_step)
        self.scheduler = Scheduler(self.kv, slots, step_tokens, prefill_step_tokens=cfg.prefill_budget)
        # one spare bundle and slot beyond what the scheduler hands out: the padding sequence's scratch
        self.cache = model.make_cache(self.num_blocks + 1, slots + 1, block_tokens)
        compile_decode = use_kernels() if cfg.compile_decode is None else cfg.compile_decode
        # with a drafter: decode-with-taps and all-verify steps, and the drafter (Speculator.use_compiled)
        self.compiled = CompiledDecode(model) if compile_decode else None
        policy = cfg.draft_policy if cfg.draft_policy is not None else \
            "adaptive" if use_kernels() or cfg.draft_costs is not None else "fixed"
        self.spec = None if drafter is None else Speculator(
            model, drafter, n_draft, self.cache, self.kv, cfg.verify_commit,
            make_policy(policy, cfg.draft_costs, self.compiled is not None, cfg.learn_draft_costs))
        # a policy whose table learns from the engine's own step times is fed by the timer (measured_costs.py)
        spec_policy = self.spec and self.spec.policy
        self.timer = StepTimer(spec_policy.observe) if getattr(spec_policy, "learns", False) else None
        self.scratch = (slots, self.num_blocks)
        if self.spec is not None:
            self.spec.use_compiled(self.compiled, self.num_blocks)  # block num_blocks: the padding bundle
        # all-verify steps launched while the previous one is in flight (spec_pipeline.py); by default where compiled
        pipelined = cfg.spec_pipeline
        if pipelined is None:
            pipelined = self.spec is not None and self.compiled is not None
        self.pipeline = SpecPipeline(self) if pipelined else None
        self.pad_buckets = cfg.pad_buckets
        self.buckets = token_buckets(cfg.prefill_budget) if self.pad_buckets else None
        self.eos = set(self.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())
        # grammar-constrained requests' matchers (structured.py)
        self.structured = Constraints(tokenizer, self.config.vocab_size, self.eos) if tokenizer is not None else None
        seed, group = cfg.seed, getattr(model, "group", None)
        if seed is None and group is not None:  # tensor parallel: every rank draws the same request seeds
            from ..model.distributed import agreed_seed  # noqa: PLC0415

            seed = agreed_seed(group)
        self._rng = random.Random(seed)
        self._seqs: dict[Any, Sequence] = {}
        self._next_id = 0
        self._inflight: _InFlight | None = None
        self._events: list[Delta] = []  # cancellations, reported by the next step
        self._held: list[Delta] = []  # deltas of submit()ted requests that arrived inside generate/stream
        self.failures = Failures(self._finish, self.cache, self.kv)
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_tokens": 0, "steps": 0, "padding_tokens": 0}

    # ---- requests
    def submit(self, prompt, sampling: SamplingParams | dict | None = None, request_id=None):
        """Queue a request; returns its id. ValueError (naming the problem) for a request that can never run."""
        params = as_params(sampling)
        ids = prompt_ids(prompt, self.tokenizer)
        check_request(ids, params, self.config.vocab_size, self.max_model_len, self.block_tokens, self.num_blocks,
                      self.tokenizer is not None)
        if request_id is None:
            while self._next_id in self._seqs:
                self._next_id += 1
            request_id, self._next_id = self._next_id, self._next_id + 1
        elif request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already live")
        matcher = None
        if params.structured is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer: Engine(tokenizer=...)")
            matcher = self.structured.matcher(params.structured)
        prompt_lps = None
        if params.prompt_logprobs is not None:  # before the request exists: a failure is its alone
            if getattr(self.model, "group", None) is not None:  # rank 0 alone would wait in its collectives
                raise ValueError("prompt logprobs are not computed under tensor parallelism")
            # the pass's state before the last token goes into the prefix cache: the prompt is computed once
            keep = self.prefix is not None and self.spec is None and params.cache_salt is None
            prompt_lps, prefix = prompt_logprobs(self.model, ids, params.prompt_logprobs, keep)
            if prefix is not None:
                self._adopt_prompt(ids[:-1], prefix)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, ids, params, seed)
        seq.prompt_logprobs = prompt_lps
        if matcher is not None:
            self.structured.admit(seq, matcher)
        if self.tokenizer is not None:
            seq.text = TextState(self.tokenizer, params.stop)
        self._seqs[request_id] = seq
        self.counters["prompt_tokens"] += len(ids)
        self.scheduler.add(seq)
        return request_id

    def cancel(self, request_id) -> bool:
        """Drop a request now: its slot and blocks are free for the next step. False if unknown/finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._events.append(self._finish(seq, "cancelled", [], time.perf_counter()))
        return True

    def has_work(self) -> bool:
        # A step still in flight when no request is left only holds tokens of finished requests (one
        # that stopped on EOS was already sent into the next step): it reports nothing, so it is no work
        # (the call that finished the last request read it back: _advance).
        return bool(self._seqs or self._events or self._held)

    # ---- the loop
    def step(self) -> list[Delta]:
        """Advance every live sequence by one step; returns the deltas read back in this call. An error
        while computing the step fails the requests it touched (finish_reason "error", `error` says why)
        and the engine goes on serving the others and the next ones (failures.py)."""
        held, self._held = self._held, []
        return held + self._advance()

    def _advance(self) -> list[Delta]:
        out, self._events = self._events, []
        if self.timer is not None:
            self.timer.call_started()
        try:
            self._step(out)
            if self._inflight is not None and not self._seqs:
                # every request finished at this read-back: the step launched before it computes only theirs,
                # and no later step would read it back (has_work() is False), which would leave its snapshots'
                # bundle references and device arrays held while the engine idles
                flight, self._inflight = self._inflight, None
                self._read_back(flight, None, out)
        except Exception as e:  # not attributable to a step: treat the device state as unsound
            out += self._fail_all(e, [self._inflight])
        if self.timer is not None:
            self.timer.call_ended()
        return out

    def _step(self, deltas: list[Delta]) -> None:
        if self.pipeline is not None and self.pipeline.step(deltas):  # launched after a verification in flight
            return
        if (self._inflight is not None and self.structured is not None
                and self.structured.must_sync(self._inflight.sampling)):  # the next masks need its tokens
            flight, self._inflight = self._inflight, None
            self._read_back(flight, None, deltas)
        if self.spec is not None:
            if self._inflight is not None and self.spec.must_sync(self._inflight, self._seqs.values()):
                flight, self._inflight = self._inflight, None  # drafting needs its tokens and kv_valid on the host
                self._read_back(flight, None, deltas)
            self.spec.plan(self._seqs.values())
        plan = self.scheduler.schedule()
        launched, failure = None, None
        if plan.scheduled:
            try:
                launched = self._launch(plan)
            except EvalFailed as e:
                deltas += self._fail_all(e.cause, [self._inflight, e.flight])
                return
            except Exception as e:  # raised while building the step: nothing of it ran
                failure = e
        if self._inflight is not None:
            flight, self._inflight = self._inflight, None
            if not self._read_back(flight, launched, deltas):
                launched, failure = None, None  # the reset failed the new step's sequences too
        if failure is not None:
            deltas += self.failures.step(plan.scheduled, failure)
        if launched is not None and launched.failed:  # after the previous step's tokens: they are theirs
            deltas += self.failures.requests(launched.failed)
        self._inflight = launched

    def _sample(self, logits: mx.array, batch: PackedBatch) -> tuple[mx.array, list, StepLogprobs | None]:
        """The batch's plain sampling rows (logits [R, V]): tokens, (sequence, error) of rows whose own sampling
        raised, their logprobs. The one place a step samples, with or without a drafter (Speculator.launch)."""
        samp = batch.sampling
        drawn = sample_rows(logits, samp, batch.input_ids, batch.logits_rows, self.structured, self.eos)
        return drawn.tokens, [(samp[r].seq, e) for r, e in drawn.failed.items()], drawn.logprobs

    def _read_back(self, flight: _InFlight, launched: _InFlight | None, deltas: list[Delta]) -> bool:
        """Commit a step; False when its read-back failed and the engine was reset (both steps dropped)."""
        try:
            deltas += self._commit(flight)
            if self.timer is not None:
                self.timer.read_back(flight.shape)
            return True
        except EvalFailed as e:
            deltas += self._fail_all(e.cause, [flight, launched])
            return False

    def _launch(self, plan: StepPlan) -> _InFlight:
        prev, scheduled = self._inflight, plan.scheduled
        plan_batch: PackedBatch = pack(
            plan, self.block_tokens,
            prev.rows if prev else None, prev.tokens if prev else None,
            self.buckets, self.scratch, self.kv.boundaries_in if self.kv.in_step else None,
        )
        c = self.counters
        c["steps"] += 1
        c["padding_tokens"] += plan_batch.padding
        c["prefill_tokens"] += sum(s.num_tokens for s in scheduled if s.start < s.seq.prompt_len)
        cache = self.cache
        # fresh slots zeroed, prefix-cache hits restored (lazily, inside this step's graph: no sync)
        snapshots = self.kv.step_snapshots(scheduled, plan_batch.reset_slots, cache)
        spec, failed, logprobs = None, [], None
        if self.spec is not None:  # drafting, taps, verification (speculative.py)
            tokens, spec, failed, logprobs = self.spec.launch(plan, plan_batch, cache, self._sample)
        elif plan_batch.logits_rows is None:  # mid-prompt chunks only: no head, no sampling
            self.model.hidden(plan_batch.input_ids, plan_batch.layout, cache)
            tokens = None
        else:
            if self.compiled is not None and self.compiled.eligible(plan_batch.layout):
                logits = self.compiled(plan_batch.input_ids, plan_batch.layout, cache, plan_batch.logits_rows)
            else:
                logits = self.model.forward(plan_batch.input_ids, plan_batch.layout, cache, plan_batch.logits_rows)
            tokens, failed, logprobs = self._sample(logits, plan_batch)
        flight = _InFlight([s.seq for s in scheduled], plan_batch.sampling, tokens,
                           {s.seq: r for r, s in enumerate(plan_batch.sampling)}, snapshots, spec, failed, logprobs,
                           decode_shape(scheduled))
        try:  # the CPU evaluates part of the graph here already: a failing kernel can raise now
            mx.async_eval(*([tokens] if tokens is not None else []), *(logprobs.arrays() if logprobs else []),
                          *cache.arrays())
            snapshots.capture()  # a separate evaluation, after the step's in-place KV writes (attention/kv_write.py)
        except Exception as e:
            raise EvalFailed(e, flight) from e
        return flight

    def _commit(self, flight: _InFlight) -> list[Delta]:
        """Read the step's tokens (the one sync) and apply them: append, check stops, finish. A failed
        read-back raises EvalFailed; an error applying one request's tokens fails that request."""
        try:
            tokens = flight.tokens.tolist() if flight.tokens is not None else []
            logprobs = flight.logprobs.read(tokens) if flight.logprobs is not None else {}
            verified = self.spec.read(flight.spec) if flight.spec is not None else None
        except Exception as e:
            raise EvalFailed(e) from e
        now = time.perf_counter()
        new: dict[Sequence, list[int]] = {}
        done: dict[Sequence, str] = {}
        failed: dict[Sequence, str] = {}
        runs = [(s, [tok], [logprobs.get(r)]) for r, (s, tok) in enumerate(zip(flight.sampling, tokens))]
        if flight.spec is not None:  # each verification yields its accepted drafts + one token
            try:
                runs += [(s, toks, None) for s, toks in self.spec.commit(flight.spec, verified)]
            except Exception as e:  # the verifying sequences' state is not committed: they fail
                msg = reason(e)
                for s in flight.spec.seqs:
                    s.seq.pending -= 1
                    failed[s.seq] = msg
        for s, toks, lps in runs:
            seq = s.seq
            seq.pending -= 1
            try:
                self._append(seq, toks, lps, new, done, now)
            except Exception as e:  # e.g. the detokenizer: this request alone
                failed[seq] = reason(e)
        if flight.snapshots is not None:  # every captured prefix's tokens are on the host now
            flight.snapshots.publish()
        deltas = []
        for seq, toks in new.items():
            if seq in failed:
                continue
            if seq in done:
                deltas.append(self._finish(seq, done[seq], toks, now))
            else:
                deltas.append(Delta(seq.request_id, toks, seq.text.delta(False) if seq.text else "",
                                    logprobs=self._logprobs(seq, len(toks)), prompt_logprobs=self._first(seq)))
        for seq, msg in failed.items():
            if seq.status is not SeqStatus.FINISHED:
                deltas.append(self._finish(seq, "error", new.get(seq, []), now, msg))
        return deltas

    def _append(self, seq: Sequence, toks: list[int], lps: list | None, new: dict, done: dict, now: float) -> None:
        """lps: each token's TokenLogprob, when its row computed one (logprobs.py)."""
        for i, tok in enumerate(toks):
            if seq.status is SeqStatus.FINISHED or seq in done:
                break  # finished or cancelled after this step was launched, or stopped inside a run
            seq.tokens.append(tok)
            new.setdefault(seq, []).append(tok)
            if seq.params.logprobs is not None:
                seq.logprobs.append(lps[i] if lps else None)
            self.counters["generated_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            p = seq.params
            complete = p.structured is not None and self.structured.consume(seq, tok)
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                done[seq] = "stop"
            elif seq.text is not None and seq.text.add(tok):
                done[seq] = "stop_string"
            elif complete:  # the grammar is complete: nothing may follow
                done[seq] = "stop"
            elif len(seq.tokens) - seq.prompt_len >= p.max_tokens:
                done[seq] = "length"

    # ---- failures (failures.py says what a failed step does)
    def _fail_all(self, e: Exception, flights: list[_InFlight | None]) -> list[Delta]:
        self._inflight = None
        if self.spec is not None:  # held-back context rows of sequences about to fail, and taps of failed steps
            self.spec.backlog.clear()
        return self.failures.device(e, flights, self._seqs.values())

    def _finish(self, seq: Sequence, reason: str, toks: list[int], now: float, error: str | None = None) -> Delta:
        if self.spec is not None:  # its held-back drafter context first: a turn entry shares its blocks
            self.spec.finishing(seq)
        self.kv.finish(seq, reason, self.cache)  # a turn entry from its slot, before the slot is released
        if self.structured is not None:
            self.structured.release(seq)
        self.scheduler.release(seq)
        self._seqs.pop(seq.request_id, None)
        if seq.text is not None and reason != "stop_string":
            seq.text.flush()
        stop_reason = seq.text.matched if reason == "stop_string" else None
        if reason == "stop" and seq.generated and seq.generated[-1] in seq.params.stop_token_ids:
            stop_reason = seq.generated[-1]
        reason = "stop" if reason == "stop_string" else reason
        seq.finish_reason, seq.finish_time = reason, now
        text = seq.text.delta(True) if seq.text else ""
        out = Output(
            seq.request_id, seq.prompt_len, list(seq.generated), seq.text.text if seq.text else "", reason, error,
            (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            now - seq.arrival_time, seq.num_preemptions, seq.cached_tokens, stop_reason,
            list(seq.logprobs) if seq.params.logprobs is not None else None, seq.prompt_logprobs,
        )
        return Delta(seq.request_id, toks, text, True, reason, error, out, self._logprobs(seq, len(toks)),
                     self._first(seq))

    @staticmethod
    def _first(seq: Sequence) -> list | None:
        """The prompt's logprobs, on the sequence's first delta only."""
        first, seq.delivered = not seq.delivered, True
        return seq.prompt_logprobs if first else None

    @staticmethod
    def _logprobs(seq: Sequence, n: int) -> list | None:
        """The logprobs of a sequence's last n tokens, when it asked for them."""
        if seq.params.logprobs is None:
            return None
        return seq.logprobs[len(seq.logprobs) - n:] if n else []

    @property
    def pool(self):
        """The KV manager's block pool (read-only view)."""
        return self.kv.pool

    @property
    def dense_bytes(self) -> int:
        """Bytes of the projections' dequantized copies the model holds (dense_weights.py); read from the model,
        which another engine on it may have equipped or stripped since."""
        return kept_bytes(self.model)

    def stats(self) -> dict:
        s = {
            "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free,
            "block_tokens": self.block_tokens,
            "slots": self.slots,
            "step_tokens": self.step_tokens,
            "kv_cache_usage": self.pool.num_used / self.pool.num_blocks,
            "dense_weight_bytes": self.dense_bytes,
            **self.scheduler.stats(),
            **self.counters,
            **self.kv.stats(),
            **(self.spec.stats() if self.spec is not None else {}),
        }
        return s
