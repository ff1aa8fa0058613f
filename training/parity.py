"""The trained pair as PyTorch trained it vs as mtlqwen runs it (float weights, before quantization):
target logits over a held-out window, and the drafter's draft logits for one block after that window.
A mismatch here (tap indexing, norm convention, RoPE, mask) would make the demo's acceptance collapse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .data import load_streams

P, BLOCK_TOKENS = 96, 32  # context length of the drafter check (spans several KV blocks)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_parity(target_dir: Path, drafter_dir: Path) -> dict:
    import mlx.core as mx
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    import mtlqwen
    from mtlqwen import SeqLayout

    from .dflash_torch import DFlashDrafter

    ids = [int(t) for t in load_streams(limit_docs=8)["heldout"][: P + 1]]
    ctx, anchor = ids[:P], ids[P]
    hf = tf.Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    dcfg = json.loads((drafter_dir / "config.json").read_text())
    taps_ids = dcfg["dflash_config"]["target_layer_ids"]
    block = dcfg["dflash_config"]["block_size"]
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        hf_logits = out.logits[0].numpy()
        taps = torch.cat([out.hidden_states[L + 1] for L in taps_ids], -1)[:, :P]
        dr = DFlashDrafter(dcfg)
        dr.load_state_dict({k: v.float() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()})
        dr.eval()
        blk = torch.tensor([[anchor] + [dcfg["dflash_config"]["mask_token_id"]] * (block - 1)])
        pos = torch.arange(P, P + block)[None]
        mask = torch.ones(1, 1, block, P + block, dtype=torch.bool)
        h = dr(taps, hf.get_input_embeddings()(blk), pos, mask)[0, 1:]
        torch_draft = hf.get_output_embeddings()(h).numpy()

    model = mtlqwen.load(target_dir)
    drafter = mtlqwen.load_drafter(drafter_dir, model)
    nb = -(-(P + block) // BLOCK_TOKENS)
    cache = model.make_cache(num_blocks=nb, num_slots=1, block_tokens=BLOCK_TOKENS)
    dcache = drafter.make_cache(cache)
    table = list(range(nb))
    lay = SeqLayout([0, P + 1], [0], [table], [0], BLOCK_TOKENS)
    logits, _ = model.forward_with_taps(mx.array(ids, dtype=mx.int32), lay, cache, drafter.tap_layers)
    cache2 = model.make_cache(num_blocks=nb, num_slots=1, block_tokens=BLOCK_TOKENS)
    ctx_lay = SeqLayout([0, P], [0], [table], [0], BLOCK_TOKENS)
    _, mtaps = model.forward_with_taps(mx.array(ctx, dtype=mx.int32), ctx_lay, cache2, drafter.tap_layers)
    drafter.write_context(mtaps, ctx_lay, dcache)
    _, mdraft = drafter.propose_with_logits([anchor], SeqLayout([0, 0], [P], [table], [0], BLOCK_TOKENS), dcache,
                                            block - 1)
    mdraft = np.asarray(mdraft[0].astype(mx.float32))
    logits = np.asarray(logits.astype(mx.float32))
    return {
        "target_logits_rel_err": round(_rel(logits, hf_logits), 5),
        "target_argmax_agree": float((logits.argmax(-1) == hf_logits.argmax(-1)).mean()),
        "draft_logits_rel_err": round(_rel(mdraft, torch_draft), 5),
        "draft_argmax_agree": float((mdraft.argmax(-1) == torch_draft.argmax(-1)).mean()),
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(check_parity(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
