"""The engine loop: submit requests, step the batch, stream deltas, collect outputs.

One `step()`: schedule (pure Python), pack, launch the model + sampler for the whole batch without
waiting, then read back the *previous* step's tokens and commit them. So the host builds step N+1
while the device runs step N; the only synchronisation is reading sampled tokens. The price is a
one-step lag: a sequence that hits EOS at step N was already sent to step N+1, whose token for it
is dropped (its writes land in blocks and a slot that are freed, and are ordered before any reuse by
MLX's data dependencies through the pool arrays).
"""

from __future__ import annotations

import operator
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx

from ..kernels import use_kernels
from ..model.cache import ModelCache
from ..model.compiled import CompiledDecode
from ..model.qwen35 import VERIFY_COMMITS
from .batch import PackedBatch, pack, token_buckets
from .block_pool import BlockPool
from .memory import device_memory, resolve_num_blocks
from .outputs import Delta, Output, TextState
from .kv_manager import KVManager, StepSnapshots
from .prefix_cache import DEFAULT_CACHE_BYTES, model_identity
from .sampling import SamplingParams, sample
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .speculative import Speculator, load_draft
from .sequence import Sequence, SeqStatus


@dataclass
class _InFlight:
    sampling: list[ScheduledSeq]
    tokens: mx.array | None  # [R] sampled ids, still on the device
    rows: dict[Sequence, int]  # row of each sampling sequence in `tokens`
    snapshots: StepSnapshots | None = None  # the step's prefix-cache captures, published at read-back
    spec: Any = None  # speculative._Verification: the step's verifying sequences, applied at read-back


def _as_params(sampling) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, dict):
        return SamplingParams(**sampling)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be SamplingParams, a dict or None, got {type(sampling).__name__}")
    sampling.validate()  # catches fields changed after construction
    return sampling


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
    )


class Engine:
    """Batched generation over a fixed number of slots with paged KV memory.

    model_or_path: a Qwen35Model or what `mtlqwen.load` accepts. tokenizer: an object with
    encode/decode/detokenizer (or a path for `mtlqwen.load_tokenizer`); when None and the model is a
    checkpoint directory holding tokenizer.json, that tokenizer is loaded. Without a tokenizer prompts
    must be token ids and outputs carry no text. The KV pool holds num_blocks bundles of block_tokens
    tokens, or kv_bytes worth, or a device-sized default (memory.py). pad_buckets=True pads each
    step's token count to a power-of-two bucket with a dummy sequence (exact: it owns a scratch slot
    and block). Off by default: MLX caches CUDA graphs by topology, not shape, and the kernels are
    specialised by dtype and head geometry, not by T, so padding would only add work; it is there
    for back-ends or compiled paths that key on shapes (runtime_bench.py --pad-buckets on measures it).
    prefix_interval: tokens between prefix-cache snapshots (default 512; 0 turns the prefix cache off);
    prefix_cache_bytes: the snapshots' memory budget (default 1 GiB), LRU-evicted (prefix_cache.py).

    draft: a DFlash drafter (Drafter, directory or repo id) for speculative decoding; n_draft: drafts per
    step (default the drafter's block_size - 1, capped so every slot can verify within step_tokens);
    a request opts out with SamplingParams(speculative=False) (speculative.py). verify_commit: how verified GDN
    states are committed, "candidates" or "replay" (see Qwen35Model); default: chosen per step by
    the number of drafts, from the H200 measurement (speculative.REPLAY_MIN_DRAFTS).

    compile_decode: run steps in which every sequence decodes one token through `mx.compile`
    (model/compiled.py); default on when the GPU kernels run, off on the CPU references. With a drafter,
    True also compiles decode steps with taps and steps in which every sequence verifies (default off
    there until it has been checked on a GPU).

    Not thread-safe: one thread calls submit/step/cancel (a server feeds it through a queue)."""

    def __init__(
        self,
        model_or_path,
        slots: int = 8,
        step_tokens: int = 128,
        block_tokens: int = 128,
        num_blocks: int | None = None,
        kv_bytes: int | None = None,
        tokenizer=None,
        max_model_len: int | None = None,
        pad_buckets: bool = False,
        seed: int | None = None,
        prefix_interval: int = 512,
        prefix_cache_bytes: int | None = None,
        draft=None,
        n_draft: int | None = None,
        compile_decode: bool | None = None,
        verify_commit: str | None = None,
    ):
        if verify_commit is not None and verify_commit not in VERIFY_COMMITS:
            raise ValueError(f"verify_commit must be one of {VERIFY_COMMITS}, got {verify_commit!r}")
        if verify_commit is not None and draft is None:
            raise ValueError("verify_commit needs a drafter (draft=...)")
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
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.model, self.config, self.tokenizer = model, model.config, tokenizer
        ctx = self.config.max_position_embeddings
        self.max_model_len = min(ctx, max_model_len) if max_model_len else ctx
        self.block_tokens, self.step_tokens, self.slots = block_tokens, step_tokens, slots
        drafter, n_draft = load_draft(model, draft, n_draft, slots, step_tokens)
        self.num_blocks = resolve_num_blocks(
            self.config, model.dtype, block_tokens, slots, self.max_model_len, num_blocks, kv_bytes,
            Speculator.bytes_per_block(drafter, block_tokens, model.dtype),  # drafter K/V share the bundles
        )
        per_block = ModelCache.bytes_per_block(self.config, block_tokens, model.dtype)
        budget = DEFAULT_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        if prefix_interval and num_blocks is None and kv_bytes is None and device_memory()[0] is not None:
            # the default KV budget was taken from free device memory: leave the snapshots' share out
            self.num_blocks = max(1, self.num_blocks - budget // per_block)
        per_entry = ModelCache.bytes_per_slot(self.config, model.dtype)
        if prefix_interval and prefix_interval % block_tokens:  # plus the copy of the partial last block
            per_entry += per_block
        identity = model_identity(model, getattr(drafter, "source", drafter))  # entries carry drafter rows
        self.kv = KVManager(self.num_blocks, block_tokens, prefix_interval, budget, identity, per_entry)
        self.scheduler = Scheduler(self.kv, slots, step_tokens)
        # one spare bundle and slot beyond what the scheduler hands out: the padding sequence's scratch
        self.cache = model.make_cache(self.num_blocks + 1, slots + 1, block_tokens)
        self.spec = None if drafter is None else Speculator(
            model, drafter, n_draft, self.cache, self.kv, verify_commit)
        self.scratch = (slots, self.num_blocks)
        auto = compile_decode is None
        if auto:
            compile_decode = use_kernels()
        # speculative steps compile only when asked for: their compiled path has not yet run on a GPU
        self.compiled = CompiledDecode(model) if compile_decode and (self.spec is None or not auto) else None
        if self.spec is not None:
            self.spec.compiled = self.compiled
        self.pad_buckets = bool(pad_buckets)
        self.buckets = token_buckets(step_tokens) if self.pad_buckets else None
        self.eos = set(self.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._rng = random.Random(seed)
        self._seqs: dict[Any, Sequence] = {}
        self._next_id = 0
        self._inflight: _InFlight | None = None
        self._events: list[Delta] = []  # cancellations, reported by the next step
        self._held: list[Delta] = []  # deltas of submit()ted requests that arrived inside generate/stream
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_tokens": 0, "steps": 0, "padding_tokens": 0}

    # ---- requests
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer: pass token ids or Engine(tokenizer=...)")
            return list(self.tokenizer.encode(prompt))
        try:
            return [operator.index(t) for t in prompt]  # ints (numpy ints too), never floats
        except TypeError:
            raise ValueError(f"a prompt is a string or a list of integer token ids, got {prompt!r:.80}") from None

    def submit(self, prompt, sampling: SamplingParams | dict | None = None, request_id=None):
        """Queue a request; returns its id. ValueError (naming the problem) for a request that can never run."""
        params = _as_params(sampling)
        ids = self._prompt_ids(prompt)
        V = self.config.vocab_size
        if not ids:
            raise ValueError("empty prompt: at least one token is needed")
        params.check_vocab(V)
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens"
            )
        # the last sampled token is never run through the model, so it needs no KV
        need = BlockPool.blocks_for(len(ids) + params.max_tokens - 1, self.block_tokens)
        if need > self.num_blocks:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of "
                f"{self.block_tokens} tokens but the pool has {self.num_blocks}: raise num_blocks/kv_bytes or lower max_tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids or Engine(tokenizer=...)")
        if request_id is None:
            while self._next_id in self._seqs:
                self._next_id += 1
            request_id, self._next_id = self._next_id, self._next_id + 1
        elif request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already live")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, ids, params, seed)
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
        # that stopped on EOS was already sent into the next step): it reports nothing, so it is no work.
        return bool(self._seqs or self._events or self._held)

    # ---- the loop
    def step(self) -> list[Delta]:
        """Advance every live sequence by one step; returns the deltas read back in this call."""
        held, self._held = self._held, []
        return held + self._step()

    def _step(self) -> list[Delta]:
        deltas, self._events = self._events, []
        if self.spec is not None:
            if self._inflight is not None and self.spec.must_sync(self._inflight):
                deltas += self._commit(self._inflight)  # drafting needs its tokens and kv_valid on the host
                self._inflight = None
            self.spec.plan(self._seqs.values())
        plan = self.scheduler.schedule()
        launched = self._launch(plan) if plan.scheduled else None
        if self._inflight is not None:
            deltas += self._commit(self._inflight)
        self._inflight = launched
        return deltas

    def _launch(self, plan: StepPlan) -> _InFlight:
        prev, scheduled = self._inflight, plan.scheduled
        plan_batch: PackedBatch = pack(
            plan, self.block_tokens,
            prev.rows if prev else None, prev.tokens if prev else None,
            self.buckets, self.scratch,
        )
        c = self.counters
        c["steps"] += 1
        c["padding_tokens"] += plan_batch.padding
        c["prefill_tokens"] += sum(s.num_tokens for s in scheduled if s.start < s.seq.prompt_len)
        cache = self.cache
        # fresh slots zeroed, prefix-cache hits restored (lazily, inside this step's graph: no sync)
        snapshots = self.kv.step_snapshots(scheduled, plan_batch.reset_slots, cache)
        spec = None
        if self.spec is not None:  # drafting, taps, verification (speculative.py)
            tokens, spec = self.spec.launch(plan, plan_batch, cache)
        elif plan_batch.logits_rows is None:  # mid-prompt chunks only: no head, no sampling
            self.model.hidden(plan_batch.input_ids, plan_batch.layout, cache)
            tokens = None
        else:
            if self.compiled is not None and self.compiled.eligible(plan_batch.layout):
                logits = self.compiled(plan_batch.input_ids, plan_batch.layout, cache, plan_batch.logits_rows)
            else:
                logits = self.model.forward(plan_batch.input_ids, plan_batch.layout, cache, plan_batch.logits_rows)
            samp = plan_batch.sampling
            tokens = sample(logits, [s.seq.params for s in samp], [s.seq.seed for s in samp], [s.sample_index for s in samp])
        mx.async_eval(*([tokens] if tokens is not None else []), *cache.arrays())
        snapshots.capture()  # a separate evaluation, after the step's in-place KV writes (kv_write_kernels.py)
        return _InFlight(plan_batch.sampling, tokens, {s.seq: r for r, s in enumerate(plan_batch.sampling)}, snapshots, spec)

    def _commit(self, flight: _InFlight) -> list[Delta]:
        """Read the step's tokens (the one sync) and apply them: append, check stops, finish."""
        tokens = flight.tokens.tolist() if flight.tokens is not None else []
        now = time.perf_counter()
        new: dict[Sequence, list[int]] = {}
        done: dict[Sequence, str] = {}
        runs = [(s, [tok]) for s, tok in zip(flight.sampling, tokens)]
        if flight.spec is not None:  # each verification yields its accepted drafts + one token
            runs += self.spec.commit(flight.spec)
        for s, toks in runs:
            seq = s.seq
            seq.pending -= 1
            for tok in toks:
                if seq.status is SeqStatus.FINISHED or seq in done:
                    break  # finished or cancelled after this step was launched, or stopped inside a run
                seq.tokens.append(tok)
                new.setdefault(seq, []).append(tok)
                self.counters["generated_tokens"] += 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                p = seq.params
                if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                    done[seq] = "stop"
                elif seq.text is not None and seq.text.add(tok):
                    done[seq] = "stop_string"
                elif len(seq.tokens) - seq.prompt_len >= p.max_tokens:
                    done[seq] = "length"
        if flight.snapshots is not None:  # every captured prefix's tokens are on the host now
            flight.snapshots.publish()
        deltas = []
        for seq, toks in new.items():
            if seq in done:
                deltas.append(self._finish(seq, done[seq], toks, now))
            else:
                deltas.append(Delta(seq.request_id, toks, seq.text.delta(False) if seq.text else ""))
        return deltas

    def _finish(self, seq: Sequence, reason: str, toks: list[int], now: float, error: str | None = None) -> Delta:
        self.kv.finish(seq, reason, self.cache)  # a turn entry from its slot, before the slot is released
        self.scheduler.release(seq)
        self._seqs.pop(seq.request_id, None)
        if seq.text is not None and reason != "stop_string":
            seq.text.flush()
        reason = "stop" if reason == "stop_string" else reason
        seq.finish_reason, seq.finish_time = reason, now
        text = seq.text.delta(True) if seq.text else ""
        out = Output(
            seq.request_id, seq.prompt_len, list(seq.generated), seq.text.text if seq.text else "", reason, error,
            (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            now - seq.arrival_time, seq.num_preemptions, seq.cached_tokens,
        )
        return Delta(seq.request_id, toks, text, True, reason, error, out)

    # ---- convenience front-ends
    def _run(self, prompts, sampling) -> Iterator[tuple[int, Delta]]:
        """(prompt index, delta) for these prompts until all finish; a request failing validation
        yields one "error" delta on its own. Deltas of other requests are kept for step()."""
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
            per = list(sampling)
        else:
            per = [sampling] * len(prompts)
        mine: dict[Any, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, per)):
            try:
                mine[self.submit(prompt, sp)] = i
            except (ValueError, TypeError) as e:
                n = len(prompt) if isinstance(prompt, (list, tuple)) else 0
                out = Output(None, n, [], "", "error", str(e))
                yield i, Delta(None, [], "", True, "error", str(e), out)
        while mine:
            for d in self._step():
                i = mine.get(d.request_id)
                if i is None:
                    self._held.append(d)
                    continue
                if d.finished:
                    del mine[d.request_id]
                yield i, d

    def stream(self, prompts, sampling=None) -> Iterator[Delta]:
        """Yield the deltas of these prompts' requests as they are produced."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        for _, d in self._run(prompts, sampling):
            yield d

    def generate(self, prompts, sampling=None, progress: bool = False) -> list[Output]:
        """Run prompts (strings or token-id lists; one SamplingParams for all or one each) to completion;
        Outputs in prompt order."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(prompts), unit="req", desc="generate")
        outputs: list[Output | None] = [None] * len(prompts)
        gen0, t0 = self.counters["generated_tokens"], time.perf_counter()
        for i, d in self._run(prompts, sampling):
            if not d.finished:
                continue
            outputs[i] = d.output
            if bar is not None:
                bar.update(1)
                rate = (self.counters["generated_tokens"] - gen0) / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} tok/s")
        if bar is not None:
            bar.close()
        return outputs

    @property
    def pool(self):
        """The KV manager's block pool (read-only view)."""
        return self.kv.pool

    @property
    def prefix(self):
        """The KV manager's prefix cache, None when off (read-only view)."""
        return self.kv.prefix

    def stats(self) -> dict:
        s = {
            "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free,
            "block_tokens": self.block_tokens,
            "slots": self.slots,
            "step_tokens": self.step_tokens,
            "kv_cache_usage": self.pool.num_used / self.pool.num_blocks,
            **self.scheduler.stats(),
            **self.counters,
            **self.kv.stats(),
            **(self.spec.stats() if self.spec is not None else {}),
        }
        return s

    def clear_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (their bundles return to the pool); returns how many."""
        return self.kv.clear()

