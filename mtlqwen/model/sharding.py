"""Tensor-parallel sharding of the Qwen3.5 graph: what each of N ranks keeps.

Megatron-style: every block's first projections are split by output rows (heads, channels,
intermediate units), its last projection by input columns, so a rank computes a partial block output
that one all-reduce (mx.distributed.all_sum) completes -- one per attention/GDN block, one per MLP/MoE.

- Full attention: q|gate rows by query head; k/v rows by KV head, or, with fewer KV heads than ranks,
  the one KV head its query heads read (replicated on N / nKV ranks); o_proj columns by query head.
- GDN: key heads and value heads split alike (value head j reads key head j // (Hv / Hk), so
  contiguous blocks keep the pairing); in_proj_qkv rows and conv1d channels per section (q | k | v),
  in_proj_z / b / a rows, A_log and dt_bias by value head; out_proj columns. The conv and recurrent
  state pools then hold only the rank's channels and heads.
- Dense MLP and the shared expert: gate/up rows, down columns by intermediate unit.
- MoE experts: intermediate-parallel (every rank keeps all experts, 1/N of each expert's units). The
  router is replicated, so every rank routes identically and no all-to-all or load imbalance arises;
  expert-parallel would leave a rank idle whenever the top-k miss its experts.
- Embedding and lm_head: rows by vocabulary (padded to a multiple of N); the embedding is completed
  by an all-reduce, the logits by an all_gather (`gather_vocab`).
- Norms, router and shared-expert gate: replicated.

Quantized weights (MLX affine: uint32-packed along the input dimension, one scale/bias per group of
`group_size` input columns) split freely by output rows; an input-column split must fall on group
boundaries, else the split is refused.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx

from .config import ConfigError, Qwen35Config


class ShardError(ConfigError):
    """The checkpoint cannot be split over this many ranks."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's place in the group."""

    rank: int
    size: int


def check_split(c: Qwen35Config, size: int) -> None:
    """Raise ShardError naming every dimension that `size` ranks cannot split."""
    if size < 1:
        raise ShardError(f"tensor parallel size must be >= 1, got {size}")
    problems = []
    need = {"num_attention_heads": c.num_attention_heads, "linear_num_key_heads": c.linear_num_key_heads,
            "linear_num_value_heads": c.linear_num_value_heads}
    if c.is_moe:
        need["moe_intermediate_size"] = c.moe_intermediate_size
        if c.shared_expert_intermediate_size:
            need["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    else:
        need["intermediate_size"] = c.intermediate_size
    for name, n in need.items():
        if n % size:
            problems.append(f"{name}={n} is not divisible by {size}")
    nkv = c.num_key_value_heads
    if nkv % size and size % nkv:
        problems.append(f"num_key_value_heads={nkv}: {size} ranks must divide it or be a multiple of it")
    if problems:
        raise ShardError(f"cannot split this model over {size} ranks: " + "; ".join(problems))


def shard_config(c: Qwen35Config, size: int) -> Qwen35Config:
    """The geometry one rank computes: its heads and intermediate units (vocab_size stays the full one,
    as the gathered logits have it). Cache pools and memory sizing built from it hold one shard."""
    check_split(c, size)
    return dataclasses.replace(
        c,
        num_attention_heads=c.num_attention_heads // size,
        num_key_value_heads=max(1, c.num_key_value_heads // size),
        linear_num_key_heads=c.linear_num_key_heads // size,
        linear_num_value_heads=c.linear_num_value_heads // size,
        intermediate_size=c.intermediate_size // size,
        moe_intermediate_size=c.moe_intermediate_size // size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // size,
        layer_types=list(c.layer_types), eos_token_ids=list(c.eos_token_ids),
        quant_overrides=dict(c.quant_overrides),
    )


def padded_vocab(vocab: int, size: int) -> int:
    return -(-vocab // size) * size


# ---- the rules: module name (after `model.layers.N.`) -> how its output rows / input columns split
_ROWS = "rows"  # output dimension (axis -2 of a matrix, axis 0 of a vector)
_COLS = "cols"  # input dimension (axis -1)


def _rule(name: str, c: Qwen35Config):
    """(axis kind, sections, kv) for a module, or None when replicated. sections: lengths along the axis,
    each split in `size` equal parts (rank r keeps part r of every section); kv: the replicated-KV case."""
    m = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
    if m is None:
        return None
    mod = m.group(1)
    kd, vd, hv = c.key_dim, c.value_dim, c.linear_num_value_heads
    table = {
        "self_attn.q_proj": (_ROWS, [c.num_attention_heads * 2 * c.head_dim]),
        "self_attn.k_proj": (_ROWS, "kv"), "self_attn.v_proj": (_ROWS, "kv"),
        "self_attn.o_proj": (_COLS, [c.num_attention_heads * c.head_dim]),
        "linear_attn.in_proj_qkv": (_ROWS, [kd, kd, vd]),
        "linear_attn.conv1d": (_ROWS, [kd, kd, vd]),
        "linear_attn.in_proj_z": (_ROWS, [vd]),
        "linear_attn.in_proj_b": (_ROWS, [hv]), "linear_attn.in_proj_a": (_ROWS, [hv]),
        "linear_attn.A_log": (_ROWS, [hv]), "linear_attn.dt_bias": (_ROWS, [hv]),
        "linear_attn.out_proj": (_COLS, [vd]),
        "mlp.gate_proj": (_ROWS, [c.intermediate_size]), "mlp.up_proj": (_ROWS, [c.intermediate_size]),
        "mlp.down_proj": (_COLS, [c.intermediate_size]),
        "mlp.switch_mlp.gate_proj": (_ROWS, [c.moe_intermediate_size]),
        "mlp.switch_mlp.up_proj": (_ROWS, [c.moe_intermediate_size]),
        "mlp.switch_mlp.down_proj": (_COLS, [c.moe_intermediate_size]),
        "mlp.shared_expert.gate_proj": (_ROWS, [c.shared_expert_intermediate_size]),
        "mlp.shared_expert.up_proj": (_ROWS, [c.shared_expert_intermediate_size]),
        "mlp.shared_expert.down_proj": (_COLS, [c.shared_expert_intermediate_size]),
    }
    return table.get(mod)


def _module_of(key: str) -> tuple[str, str]:
    """'a.b.weight' -> ('a.b', 'weight'); A_log / dt_bias are their own module."""
    if key.endswith(("A_log", "dt_bias")):
        return key, ""
    mod, _, part = key.rpartition(".")
    return mod, part


def _ranges(sections: list[int], rank: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of rank's part of each section, in the module's (logical) units."""
    out, base = [], 0
    for n in sections:
        per = n // size
        out.append((base + rank * per, base + (rank + 1) * per))
        base += n
    return out


def _take(t: mx.array, ranges: list[tuple[int, int]], axis: int) -> mx.array:
    parts = [mx.take(t, mx.arange(a, b), axis=axis) for a, b in ranges]  # take: a copy, not a view
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _scale(ranges, factor_num: int, factor_den: int, what: str):
    """Logical column ranges -> ranges in a packed tensor whose axis holds num/den units per column."""
    out = []
    for a, b in ranges:
        if (a * factor_num) % factor_den or (b * factor_num) % factor_den:
            raise ShardError(what)
        out.append((a * factor_num // factor_den, b * factor_num // factor_den))
    return out


def shard_weights(weights: dict[str, mx.array], c: Qwen35Config, shard: Shard) -> dict[str, mx.array]:
    """The tensors rank `shard.rank` keeps (internal names, possibly quantized; `c` is the FULL config).
    Each kept tensor is a fresh array (mx.take / concatenate), so evaluating them holds no reference to
    the full tensors once those are dropped."""
    check_split(c, shard.size)
    r, n = shard.rank, shard.size
    out: dict[str, mx.array] = {}
    for key, t in weights.items():
        mod, part = _module_of(key)
        if mod in ("model.embed_tokens", "lm_head"):
            out[key] = _vocab_rows(t, c.vocab_size, shard)
            continue
        rule = _rule(mod, c)
        if rule is None:
            out[key] = t
            continue
        kind, sections = rule
        if sections == "kv":  # k/v rows: whole KV heads
            nkv, hd = c.num_key_value_heads, c.head_dim
            if nkv % n == 0:
                ranges = _ranges([nkv * hd], r, n)
            else:  # fewer KV heads than ranks: the one KV head this rank's query heads read
                h = r // (n // nkv)
                ranges = [(h * hd, (h + 1) * hd)]
        else:
            ranges = _ranges(sections, r, n)
        if kind == _ROWS:
            out[key] = _take(t, ranges, axis=0 if t.ndim == 1 else t.ndim - 2)
            continue
        spec = c.quant_overrides.get(mod, c.quantization)
        if part == "weight" and f"{mod}.scales" in weights:  # packed: bits/32 words per input column
            what = f"{mod}: the column split {ranges} does not fall on {spec.group_size}-column groups"
            _scale(ranges, 1, spec.group_size, what)
            ranges = _scale(ranges, spec.bits, 32, what)
        elif part in ("scales", "biases"):
            ranges = _scale(ranges, 1, spec.group_size,
                            f"{mod}: the column split {ranges} does not fall on {spec.group_size}-column groups")
        out[key] = _take(t, ranges, axis=t.ndim - 1)
    return out


def _vocab_rows(t: mx.array, vocab: int, shard: Shard) -> mx.array:
    """Rank's rows of a [vocab, ...] table, padded with zero rows to a multiple of N (zero rows give
    logit 0, dropped after the gather, and are never looked up)."""
    per = padded_vocab(vocab, shard.size) // shard.size
    a, b = shard.rank * per, min((shard.rank + 1) * per, vocab)
    rows = mx.take(t, mx.arange(a, max(a, b)), axis=0)
    short = per - rows.shape[0]
    if short:
        rows = mx.concatenate([rows, mx.zeros((short, *t.shape[1:]), dtype=t.dtype)])
    return rows


def vocab_range(vocab: int, shard: Shard) -> tuple[int, int]:
    per = padded_vocab(vocab, shard.size) // shard.size
    return shard.rank * per, (shard.rank + 1) * per


def gather_vocab(local: mx.array, vocab: int, group) -> mx.array:
    """Per-rank logits [..., V/N] -> full logits [..., vocab], identical on every rank."""
    n, lead, per = group.size(), local.shape[:-1], local.shape[-1]
    flat = local.reshape(-1, per)  # [T, V/N]
    full = mx.distributed.all_gather(flat, group=group)  # [N * T, V/N], rank-major
    T = flat.shape[0]
    full = full.reshape(n, T, per).transpose(1, 0, 2).reshape(T, n * per)[:, :vocab]
    return full.reshape(*lead, vocab)


def embed_vocab(embed, ids: mx.array, vocab: int, shard: Shard, group) -> mx.array:
    """Vocab-parallel embedding lookup: each rank fills the rows of its ids, an all_sum completes them."""
    lo, hi = vocab_range(vocab, shard)
    mine = (ids >= lo) & (ids < hi)
    local = mx.where(mine, ids - lo, 0)
    rows = embed.rows(local)  # [T, H]
    rows = rows * mine[:, None].astype(rows.dtype)
    return mx.distributed.all_sum(rows, group=group)
