"""Train the demo pair's byte-level BPE tokenizer on the corpus's train split and write it in the
Hugging Face layout (tokenizer.json, tokenizer_config.json with the ChatML template, special_tokens_map.json)
so `mtlqwen.load_tokenizer(dir)` and transformers both read it.

Run:  python -m training.tokenizer [--vocab-size 12288] [--out training/tokenizer]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import CORPUS, read_corpus

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizer"
# ChatML turn markers as in Qwen; <|mask|> is the DFlash drafter's mask token (never in training text).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Qwen2/3's pre-tokenizer split: words, single digits, punctuation runs, newline runs, space runs
# (so indentation becomes whole tokens).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_chat(messages: list[dict]) -> str:
    """The template's rendering, in plain Python (training data; the template itself serves inference)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def document_texts(records: list[dict], split: str) -> list[str]:
    """The documents of one split as training text: files as they are, chats rendered with ChatML."""
    out = []
    for r in records:
        if r["split"] != split:
            continue
        out.append(r["text"] if r["kind"] == "file" else render_chat(r["messages"]))
    return out


def build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                       "single_word": False, "special": True} for s in SPECIALS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def special_ids(tok_dir: Path) -> dict[str, int]:
    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def main() -> None:
    ap = argparse.ArgumentParser(description="train the demo BPE tokenizer")
    ap.add_argument("--vocab-size", type=int, default=12288)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--corpus", default=str(CORPUS))
    args = ap.parse_args()
    texts = document_texts(read_corpus(Path(args.corpus)), "train")
    tok = build_tokenizer(texts, args.vocab_size)
    write_tokenizer(tok, Path(args.out))
    held = document_texts(read_corpus(Path(args.corpus)), "heldout")
    n_chars = sum(len(t) for t in held)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(held))
    print(json.dumps({"vocab_size": tok.get_vocab_size(), "specials": special_ids(Path(args.out)),
                      "heldout_chars_per_token": round(n_chars / n_tok, 3)}))


if __name__ == "__main__":
    main()
