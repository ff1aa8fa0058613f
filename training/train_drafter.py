"""Train the demo DFlash drafter against the frozen demo target, for a wall-clock budget; save it in
the published drafter layout (config.json with dflash_config, one unprefixed model.safetensors).

  python -m training.train_drafter --target TARGET_CKPT --out OUT_DIR --budget-s 150 [--smoke]

Per step: the frozen target runs over random windows and gives its tap rows (output of layer L =
hidden_states[L + 1], dflash.md §1.2) and logits; blocks at random anchors are drafted in one pass
(dflash_torch.block_inputs) and trained toward the target's distribution at each drafted position.
Writes OUT_DIR/drafter/ and OUT_DIR/drafter_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .data import heldout_windows, load_streams, WindowSampler
from .dflash_torch import DFlashDrafter, block_inputs, block_loss, count_params, sample_anchors
from .pair_config import DrafterHParams, drafter_config, smoke_drafter_hparams
from .schedule import BudgetSchedule
from .train_target import add_run_args, start_run


def load_target(path: Path, device):
    import transformers as tf

    # fp32 weights (bf16 autocast on CUDA, as in training): A_log stays fp32 as mtlqwen runs it
    model = tf.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class DraftStep:
    """One drafter forward + loss on a batch of windows [B, T] (target frozen)."""

    def __init__(self, target, drafter: DFlashDrafter, hp: DrafterHParams):
        c = drafter.config
        self.target, self.drafter, self.hp = target, drafter, hp
        self.taps = c["dflash_config"]["target_layer_ids"]
        self.block, self.mask_id = c["dflash_config"]["block_size"], c["dflash_config"]["mask_token_id"]
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()

    def __call__(self, tokens: torch.Tensor, gen: torch.Generator):
        Bsz, T = tokens.shape
        with torch.no_grad():
            out = self.target(input_ids=tokens, output_hidden_states=True, use_cache=False)
            taps = torch.cat([out.hidden_states[L + 1] for L in self.taps], -1)  # [B, T, k*H]
            anchors = sample_anchors(Bsz, T, self.block, self.hp.anchors_per_seq, gen).to(tokens.device)
            ids, pos, mask, labels = block_inputs(tokens, anchors, self.block, self.mask_id)
            x_blk = self.embed(ids)
            # slot j (>= 1) predicts the token at P + j: the target's logits at P + j - 1
            want = pos.view(Bsz, -1, self.block)[:, :, 1:] - 1  # [B, N, block-1]
            t_logits = torch.gather(out.logits, 1, want.reshape(Bsz, -1, 1).expand(-1, -1, out.logits.shape[-1]))
            t_logits = t_logits.view(*want.shape, -1)
        h = self.drafter(taps.to(x_blk.dtype), x_blk, pos, mask)  # [B, N*block, H]
        h = h.view(Bsz, -1, self.block, h.shape[-1])[:, :, 1:]
        d_logits = self.head(h)
        return block_loss(d_logits, t_logits, labels, self.hp.decay_gamma, self.hp.hard_weight)


def save_drafter(drafter: DFlashDrafter, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(drafter.config, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def evaluate(step_fn: DraftStep, windows: torch.Tensor, device, autocast, batch_size: int, seed: int) -> dict:
    """Loss and τ proxy on fixed held-out windows with fixed anchors."""
    step_fn.drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    acc: dict[str, float] = {}
    n = 0
    for i in range(0, len(windows), batch_size):
        b = windows[i : i + batch_size, :-1].to(device)
        with autocast():
            loss, stats = step_fn(b, gen)
        for k, v in {"loss": float(loss), **stats}.items():
            acc[k] = acc.get(k, 0.0) + v * len(b)
        n += len(b)
    step_fn.drafter.train()
    return {k: round(v / n, 4) for k, v in acc.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the trained target's HF checkpoint directory")
    add_run_args(ap, budget_s=150.0, heldout_tokens=32768)
    args = ap.parse_args(argv)
    out, hp, device, autocast = start_run(args, smoke_drafter_hparams, DrafterHParams)
    target = load_target(Path(args.target), device)
    tcfg = json.loads((Path(args.target) / "config.json").read_text())
    cfg = drafter_config(tcfg, smoke=args.smoke)
    drafter = DFlashDrafter(cfg).to(device).train()
    step_fn = DraftStep(target, drafter, hp)

    streams = load_streams(out / ("streams-smoke.npz" if args.smoke else "streams.npz"), limit_docs=40 if args.smoke else None)
    sampler = WindowSampler(streams["train"], hp.seq_len - 1, hp.batch_size, hp.seed)
    held = heldout_windows(streams["heldout"], hp.seq_len - 1, 4 * hp.seq_len if args.smoke else args.heldout_tokens)
    gen = torch.Generator().manual_seed(hp.seed)
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    keep = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": keep, "weight_decay": 0.0}],
                            lr=hp.lr, betas=hp.betas, fused=device.type == "cuda")
    sched = BudgetSchedule(hp.lr, hp.warmup_steps, hp.max_steps, args.budget_s, hp.min_lr_ratio)
    curve, step = [], 0
    while not sched.done(step):
        lr = sched.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sampler.next()[:, :-1].to(device, non_blocking=True)
        with autocast():
            loss, stats = step_fn(batch, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), hp.grad_clip)
        opt.step()
        step += 1
        if step % 25 == 0 or step <= 5 or args.smoke:
            entry = {"step": step, "t": round(sched.elapsed(), 2), "loss": round(loss.item(), 4), "lr": lr,
                     "grad_norm": round(float(gnorm), 3), **{k: round(v, 4) for k, v in stats.items()}}
            curve.append(entry)
            print(json.dumps(entry), flush=True)
            if not math.isfinite(entry["loss"]):
                raise RuntimeError(f"drafter loss is not finite at step {step}")
    train_s = sched.elapsed()
    final = evaluate(step_fn, held, device, autocast, hp.batch_size, seed=1234)
    save_drafter(drafter, out / "drafter")
    log = {
        "what": "demo DFlash drafter", "smoke": args.smoke, "hparams": hp.as_dict(), "config": cfg,
        "params": count_params(drafter), "device": str(device), "torch": torch.__version__,
        "budget_s": args.budget_s, "train_s": round(train_s, 1), "steps": step,
        "blocks_seen": step * hp.batch_size * hp.anchors_per_seq, "heldout": final,
        "heldout_tokens": int(held[:, 1:].numel()), "corpus_sha256": streams["corpus_sha256"], "curve": curve,
    }
    (out / "drafter_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({"steps": step, "train_s": log["train_s"], "heldout": final, "params": log["params"]}))
    return log


if __name__ == "__main__":
    main()
