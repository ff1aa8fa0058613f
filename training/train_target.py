"""Train the demo target: a small hybrid Qwen3.5 (transformers' Qwen3_5ForCausalLM, GDN 3:1 gated
attention) on the stdlib token stream, for a wall-clock budget; save it in the official HF layout.

  python -m training.train_target --out OUT_DIR --budget-s 330 [--smoke]

Writes OUT_DIR/checkpoint/ (config.json, generation_config.json, model.safetensors in bf16 with A_log
in fp32, the tokenizer files) and OUT_DIR/target_log.json (hyper-parameters, seeds, data, loss curve,
held-out loss). On CUDA the forward runs under bf16 autocast with fp32 master weights.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import heldout_windows, load_streams, WindowSampler
from .pair_config import TargetHParams, override, smoke_target_hparams, target_text_config
from .schedule import BudgetSchedule
from .tokenizer import OUT as TOKENIZER_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def add_run_args(ap, budget_s: float, heldout_tokens: int) -> None:
    """The flags both trainers take: output, wall-clock budget, smoke mode, held-out size, overrides."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=budget_s, help="wall-clock training budget (s)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps (CPU check of the pipeline)")
    ap.add_argument("--heldout-tokens", type=int, default=heldout_tokens)
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="override hyper-parameters (e.g. batch_size=2 seq_len=128 max_steps=3: the full-size "
                         "model on a CPU for a few steps)")


def start_run(args, smoke_hparams, full_hparams):
    """(out dir, hyper-parameters, device, autocast) once the flags are parsed; seeds torch."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hp = override(smoke_hparams() if args.smoke else full_hparams(), args.set)
    torch.manual_seed(hp.seed)
    return (out, hp, *device_and_autocast())


def device_and_autocast():
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda"), lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False)


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows [B, T + 1]."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, device, autocast, batch_size: int) -> float:
    """Token-weighted mean loss over the fixed held-out windows."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = windows[i : i + batch_size].to(device)
        with autocast():
            total += float(lm_loss(model, b)) * b[:, 1:].numel()
        n += b[:, 1:].numel()
    model.train()
    return total / n


def param_groups(model, weight_decay: float):
    """No decay on norms, biases, A_log / dt_bias, or the (tied) embedding."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if p.ndim < 2 or "embed" in name or name.endswith(("A_log", "dt_bias")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def save_checkpoint(model, dest: Path) -> None:
    """bf16 weights except A_log (fp32, as the official files keep it); config eos ids; tokenizer files."""
    a_logs = {n: p.detach().float().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    model = model.to(torch.bfloat16)
    params = dict(model.named_parameters())
    for n, v in a_logs.items():
        params[n].data = v.to(params[n].device)
    model.save_pretrained(dest)
    cfg = json.loads((dest / "config.json").read_text())
    gen_path = dest / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(eos_token_id=cfg["eos_token_id"], pad_token_id=cfg.get("pad_token_id"))
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_DIR / f, dest / f)


def main(argv=None) -> dict:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, budget_s=330.0, heldout_tokens=131072)
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    out, hp, device, autocast = start_run(args, smoke_target_hparams, TargetHParams)

    t_data = time.perf_counter()
    streams = load_streams(out / ("streams-smoke.npz" if args.smoke else "streams.npz"), limit_docs=40 if args.smoke else None)
    sampler = WindowSampler(streams["train"], hp.seq_len, hp.batch_size, hp.seed)
    held = heldout_windows(streams["heldout"], hp.seq_len, 4 * hp.seq_len if args.smoke else args.heldout_tokens)
    t_data = time.perf_counter() - t_data

    text_cfg = target_text_config(tokenizer_vocab_size(), smoke=args.smoke)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text_cfg)).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, hp.weight_decay), lr=hp.lr, betas=hp.betas,
                            fused=device.type == "cuda")
    sched = BudgetSchedule(hp.lr, hp.warmup_steps, hp.max_steps, args.budget_s, hp.min_lr_ratio)
    curve, evals = [], []
    step, last_eval, tokens = 0, 0.0, 0
    while not sched.done(step):
        lr = sched.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sampler.next().to(device, non_blocking=True)
        with autocast():
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        opt.step()
        step += 1
        tokens += batch[:, 1:].numel()
        if step % 25 == 0 or step <= 5 or args.smoke:
            entry = {"step": step, "t": round(sched.elapsed(), 2), "loss": round(loss.item(), 4),
                     "lr": lr, "grad_norm": round(float(gnorm), 3), "tokens": tokens}
            curve.append(entry)
            print(json.dumps(entry), flush=True)
            if not math.isfinite(entry["loss"]):
                raise RuntimeError(f"target loss is not finite at step {step}")
        if sched.elapsed() - last_eval >= args.eval_every_s:
            last_eval = sched.elapsed()
            evals.append({"step": step, "t": round(last_eval, 1),
                          "heldout_loss": round(heldout_loss(model, held, device, autocast, hp.batch_size), 4)})
            print(json.dumps(evals[-1]), flush=True)
    train_s = sched.elapsed()
    final = heldout_loss(model, held, device, autocast, hp.batch_size)
    evals.append({"step": step, "t": round(sched.elapsed(), 1), "heldout_loss": round(final, 4)})
    ckpt = out / "checkpoint"
    save_checkpoint(model, ckpt)
    log = {
        "what": "demo target (Qwen3_5ForCausalLM)", "smoke": args.smoke, "hparams": hp.as_dict(),
        "text_config": text_cfg, "params": n_params, "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "torch": torch.__version__, "transformers": tf.__version__,
        "budget_s": args.budget_s, "train_s": round(train_s, 1), "data_s": round(t_data, 1),
        "steps": step, "tokens_seen": tokens, "train_tokens": int(len(streams["train"])),
        "epochs": round(tokens / len(streams["train"]), 3),
        "heldout_tokens": int(held[:, 1:].numel()), "heldout_loss": final,
        "corpus_sha256": streams["corpus_sha256"], "docs": streams["docs"],
        "curve": curve, "evals": evals,
    }
    (out / "target_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "epochs", "heldout_loss", "train_s", "params")}))
    return log


if __name__ == "__main__":
    main()
