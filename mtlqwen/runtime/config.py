"""EngineConfig: every knob of an Engine in one validated, printable value.

`Engine(model, slots=4, ...)` builds one from its keyword arguments; `Engine(model, config=EngineConfig(...))`
takes one as is (keywords given as well override its fields). What can be checked without the model is
checked here, once, at construction; what needs the model or the drafter (n_draft against the drafter's
block size, the pool against a request) is checked where they are known.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..model.qwen35 import VERIFY_COMMITS

DRAFT_POLICIES = ("fixed", "adaptive")


def _int(name: str, v, lo: int, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}{' or None' if optional else ''}, got {v!r}")


# Prompt tokens a step may take when no sequence is decoding: a 4096-token prompt prefilled at 11.0k
# tok/s with 1024-token steps against 5.9k with 128 on the H200 (9B shape, benchmarks/qgemm.md); with
# decoders in the batch the budget stays step_tokens, so their latency does not change.
DEFAULT_PREFILL_STEP = 1024
# Tokens a step takes while sequences decode, unless the engine is told otherwise (EngineConfig.step_budget).
DEFAULT_STEP_TOKENS = 128


@dataclass(frozen=True)
class EngineConfig:
    """The fields are Engine's keyword arguments.

    The KV pool holds num_blocks bundles of block_tokens tokens, or kv_bytes worth, or a device-sized default (memory.py). pad_buckets=True pads each
    step's token count to a power-of-two bucket with a dummy sequence (exact: it owns a scratch slot
    and block). Off by default: MLX caches CUDA graphs by topology, not shape, and the kernels are
    specialised by dtype and head geometry, not by T, so padding would only add work; it is there
    for back-ends or compiled paths that key on shapes (runtime_bench.py --pad-buckets on measures it).
    prefill_step_tokens: the token budget of a step in which no sequence decodes (default
    config.DEFAULT_PREFILL_STEP = 1024, never below step_tokens): a long prompt nobody waits behind is not
    cut into step_tokens chunks; with decoders in the batch every step keeps step_tokens.
    prefix_interval: tokens between prefix-cache snapshots (default 512; 0 turns the prefix cache off);
    prefix_cache_bytes: the snapshots' memory budget (default 1 GiB), LRU-evicted (prefix_cache.py).
    prefix_in_step: prefill chunks run across snapshot boundaries, the GDN states there taken inside the
    step (model/gdn_taps.py), instead of every chunk stopping at the next boundary (default off).

    draft: a DFlash drafter (Drafter, directory or repo id) for speculative decoding; n_draft: drafts per
    step (default the drafter's block_size - 1; with step_tokens given, capped so every slot can verify within
    it; without, the step budget grows from 128 to slots x (n_draft + 1) where that is more);
    a request opts out with SamplingParams(speculative=False) (speculative.py). verify_commit: how verified GDN
    states are committed, "candidates" or "replay" (see Qwen35Model); default: chosen per step by
    the step's verify rows, from the H200 measurement (speculative.REPLAY_MIN_ROWS).
    draft_policy: "fixed" (every eligible sequence sends n_draft drafts), "adaptive" (draft length and
    speculating sequences per step from a step-cost table and each sequence's running acceptance, so that
    by the table a drafter never slows the engine; n_draft is then the longest run) or a policy object
    (draft_policy.py); default adaptive when the GPU kernels run (the default table is the H200's) or
    draft_costs is given, else fixed. draft_costs: the adaptive policy's table, a draft_policy.StepCosts or a JSON
    file (spec_bench.py --json output); default draft_policy.H200_9B_COMPILED_COSTS when steps compile, else
    H200_9B_COSTS. learn_draft_costs: the policy prices steps with that table corrected by the engine's own
    step times (runtime/measured_costs.py), for a model, drafter or machine other than the table's; off by
    default (benchmarks/spec.md, "Step costs the engine learns", says what it has and has not been measured
    on). Each sequence's drafts are rounded down to a draft length (draft_policy.draft_lengths:
    1, 3, 7, 15 and n_draft), so that few compiled traces and kernel instantiations serve a workload. draft_bits: 8 or 4 quantizes
    the drafter's projections (group 64): at load for a directory or repo id, into a new Drafter for a
    loaded float one (model/dflash.quantize_drafter).

    compile_decode: run steps in which every sequence decodes one token through `mx.compile`
    (model/compiled.py); default on when the GPU kernels run, off on the CPU references (the uncompiled
    graphs are the references). With a drafter it also compiles decode steps with taps, steps in which
    every sequence verifies, and the drafter's proposals and context writes (model/compiled_draft.py);
    mixed steps (prefill chunks next to verifications) stay uncompiled. spec_pipeline (compiled engines,
    greedy requests) launches an all-verify step while the previous one is in flight (runtime/spec_pipeline.py
    says when it falls back to the synchronous rule); default on where the steps are compiled (benchmarks/spec.md:
    1.89x -> 2.33x plain at 1 request and 1.54x -> 2.25x at 8 on the H200, tau 6).

    dense_weights: keep a dequantized copy of each quantized decoder projection (the scales' dtype: 4x a 4-bit
    model's projections) for the GEMMs past qgemm's rows (prefill chunks, wide verifications), which otherwise
    dequantize their weights every step (runtime/dense_weights.py); default on with the CUDA kernels where the
    copies fit in a third of the device memory the weights leave, else off; never on the CPU references, which read
    the quantized weights. `engine.dense_bytes` (stats' `dense_weight_bytes`): what they hold.
    """

    slots: int = 8
    step_tokens: int | None = None  # None: step_budget's default
    # a step in which nobody decodes may take up to this many prompt tokens (None: DEFAULT_PREFILL_STEP)
    prefill_step_tokens: int | None = None
    block_tokens: int = 128
    num_blocks: int | None = None  # else kv_bytes worth, else a device-sized default (memory.py)
    kv_bytes: int | None = None
    max_model_len: int | None = None  # None: the model's context
    pad_buckets: bool = False
    seed: int | None = None  # the engine's draw of seeds for requests that give none
    prefix_interval: int = 512  # 0 turns the prefix cache off
    prefix_cache_bytes: int | None = None  # None: prefix_cache.DEFAULT_CACHE_BYTES
    # prefill chunks run across snapshot boundaries, the GDN states there taken inside the step
    # (model/gdn_taps.py); off: each chunk stops at the next boundary. Off until timed on a GPU
    prefix_in_step: bool = False
    draft: Any = None  # a Drafter, a directory or a repo id
    n_draft: int | None = None
    compile_decode: bool | None = None  # None: on when the GPU kernels run (with a drafter too: its pass included)
    verify_commit: str | None = None  # None: chosen per step (speculative.commit_mode_for)
    draft_policy: Any = None  # "fixed" | "adaptive" | a policy object; None: adaptive on the GPU kernels or
    # with draft_costs, else fixed
    draft_costs: Any = None  # the adaptive policy's step-cost table (StepCosts or JSON path); None: H200's
    # correct that table with the engine's own step times (measured_costs.py); None: off
    learn_draft_costs: bool | None = None
    draft_bits: int | None = None  # 8 or 4: quantize the drafter's projections at load; None: as stored
    # launch an all-verify step while the previous one is in flight (spec_pipeline.py); None: on where the steps are
    # compiled (the GPU kernels' default). H200, 9B, tau 6 end to end: 1.89x -> 2.33x plain at 1 request, 1.54x ->
    # 2.25x at 8 (benchmarks/spec.md, "The pipelined step, end to end")
    spec_pipeline: bool | None = None
    # keep a dequantized copy of each quantized decoder projection for the GEMMs past qgemm's rows (prefill
    # chunks), which otherwise dequantize every step (dense_weights.py); None: on with the CUDA kernels where
    # the copies fit in a third of the device memory the weights leave
    dense_weights: bool | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the offending field."""
        _int("slots", self.slots, 1)
        _int("step_tokens", self.step_tokens, 1, optional=True)
        # otherwise some live sequence could not advance in a step
        if self.step_tokens is not None and self.step_tokens < self.slots:
            raise ValueError(f"step_tokens ({self.step_tokens}) must be >= slots x tokens per decode "
                             f"({self.slots} x 1)")
        _int("prefill_step_tokens", self.prefill_step_tokens, 1, optional=True)
        _int("block_tokens", self.block_tokens, 1)
        if self.num_blocks is not None and self.kv_bytes is not None:
            raise ValueError("give num_blocks or kv_bytes, not both")
        _int("num_blocks", self.num_blocks, 1, optional=True)
        _int("kv_bytes", self.kv_bytes, 1, optional=True)
        _int("max_model_len", self.max_model_len, 1, optional=True)
        if not isinstance(self.prefix_interval, int) or isinstance(self.prefix_interval, bool) or self.prefix_interval < 0:
            raise ValueError(f"prefix_interval must be >= 1 (0 turns the cache off), got {self.prefix_interval!r}")
        _int("prefix_cache_bytes", self.prefix_cache_bytes, 0, optional=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        optional = ("compile_decode", "spec_pipeline", "dense_weights", "learn_draft_costs")
        for name in ("pad_buckets", "prefix_in_step") + optional:
            v = getattr(self, name)
            if not (isinstance(v, bool) or (v is None and name in optional)):
                raise ValueError(f"{name} must be true or false, got {v!r}")
        if self.n_draft is not None and self.draft is None:
            raise ValueError("n_draft needs a drafter (draft=...)")
        if self.verify_commit is not None and self.verify_commit not in VERIFY_COMMITS:
            raise ValueError(f"verify_commit must be one of {VERIFY_COMMITS}, got {self.verify_commit!r}")
        if self.verify_commit is not None and self.draft is None:
            raise ValueError("verify_commit needs a drafter (draft=...)")
        if isinstance(self.draft_policy, str) and self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {DRAFT_POLICIES} or a policy object, got {self.draft_policy!r}")
        if self.draft_policy is not None and not isinstance(self.draft_policy, str) and not callable(
                getattr(self.draft_policy, "choose", None)):
            raise ValueError(f"draft_policy must be one of {DRAFT_POLICIES} or a policy object, got {self.draft_policy!r}")
        for name in ("draft_costs", "learn_draft_costs"):
            if getattr(self, name) not in (None, False) and self.draft_policy not in (None, "adaptive"):
                raise ValueError(f"{name} is the adaptive policy's (draft_policy='adaptive')")
        if self.draft_bits is not None and (isinstance(self.draft_bits, bool) or self.draft_bits not in (4, 8)):
            raise ValueError(f"draft_bits must be 4, 8 or None, got {self.draft_bits!r}")
        for name in ("draft_policy", "draft_costs", "learn_draft_costs", "draft_bits", "spec_pipeline"):
            if getattr(self, name) not in (None, False) and self.draft is None:
                raise ValueError(f"{name} needs a drafter (draft=...)")

    def step_budget(self, drafts: int = 0) -> int:
        """Tokens a step takes: step_tokens, or by default DEFAULT_STEP_TOKENS raised to slots x (drafts + 1), so
        that with a drafter every slot can verify `drafts` (the default draft length) in one step: at 32 slots
        and 128 tokens only 3 drafts would fit, where a speculative step costs 3.7 plain ones (benchmarks/spec.md)."""
        if self.step_tokens is not None:
            return self.step_tokens
        return max(DEFAULT_STEP_TOKENS, self.slots * (drafts + 1))

    @property
    def prefill_budget(self) -> int:
        """Tokens a step takes when nobody decodes (never below the step budget without drafts)."""
        v = DEFAULT_PREFILL_STEP if self.prefill_step_tokens is None else self.prefill_step_tokens
        return max(self.step_budget(), v)

    @classmethod
    def build(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """`config` with `options` overriding its fields (TypeError names an unknown option)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        base = {f.name: getattr(config, f.name) for f in fields(cls)} if config is not None else {}
        return cls(**{**base, **options})

    def __str__(self) -> str:
        """One `name=value` per line, the fields that differ from the defaults marked with *."""
        default = EngineConfig()
        return "\n".join(f"{'*' if getattr(self, f.name) != getattr(default, f.name) else ' '} {f.name}={getattr(self, f.name)!r}"
                         for f in fields(self))
