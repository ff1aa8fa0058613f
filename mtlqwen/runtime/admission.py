"""What a request must be to enter the engine: its sampling parameters, its prompt as token ids, and the
limits it has to fit (vocabulary, context, KV pool). Engine.submit raises the ValueError these name, so a
request that can never run is refused before it takes a slot."""

from __future__ import annotations

import operator

from .block_pool import BlockPool
from .sampling import SamplingParams


def as_params(sampling) -> SamplingParams:
    """SamplingParams from what submit() accepts: SamplingParams, a dict of its fields, or None."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, dict):
        return SamplingParams(**sampling)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be SamplingParams, a dict or None, got {type(sampling).__name__}")
    sampling.validate()  # catches fields changed after construction
    return sampling


def prompt_ids(prompt, tokenizer) -> list[int]:
    """A prompt (a string, encoded by the tokenizer, or integer token ids) as a list of ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is a string but the engine has no tokenizer: pass token ids or Engine(tokenizer=...)")
        return list(tokenizer.encode(prompt))
    try:
        return [operator.index(t) for t in prompt]  # ints (numpy ints too), never floats
    except TypeError:
        raise ValueError(f"a prompt is a string or a list of integer token ids, got {prompt!r:.80}") from None


def check_request(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, block_tokens: int,
                  num_blocks: int, has_tokenizer: bool) -> None:
    """ValueError naming the problem when the request can never run on this engine."""
    V = vocab_size
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    params.check_vocab(V)
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
            f"{max_model_len} tokens"
        )
    # the last sampled token is never run through the model, so it needs no KV
    need = BlockPool.blocks_for(len(ids) + params.max_tokens - 1, block_tokens)
    if need > num_blocks:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of "
            f"{block_tokens} tokens but the pool has {num_blocks}: raise num_blocks/kv_bytes or lower max_tokens"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids or Engine(tokenizer=...)")
