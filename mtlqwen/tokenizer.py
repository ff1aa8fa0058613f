"""Tokenizer for Qwen3.5 checkpoints: `tokenizer.json` via the `tokenizers` library, eos ids from the
checkpoint configs, the checkpoint's chat template, and a streaming detokenizer.

`load_tokenizer(path_or_repo_id)` accepts a local checkpoint directory or a Hugging Face repo id.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import tokenizers

from .chat_template import render_chat_template

# Tokenizer-side files only: loading a tokenizer must not pull multi-GB weights.
HUB_ALLOW_PATTERNS = ["*.json", "*.jinja", "*.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Passed to templates as HF does (`{{ bos_token }}`, `{{ eos_token }}` ...).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_tokenizer(path_or_repo_id: str | os.PathLike) -> "Tokenizer":
    """Load the tokenizer of a checkpoint directory, or of a Hub repo (tokenizer/config files only)."""
    return Tokenizer.from_dir(resolve_checkpoint_dir(path_or_repo_id))


def resolve_checkpoint_dir(path_or_repo_id: str | os.PathLike) -> Path:
    """An existing local directory, else the snapshot of a Hub repo; FileNotFoundError when neither."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{str(path_or_repo_id)!r} is a file; expected a checkpoint directory")
    name = str(path_or_repo_id)
    # Only strings shaped like `owner/name` go to the Hub; a mistyped local path fails here, offline.
    if not isinstance(path_or_repo_id, str) or not _REPO_ID.match(name) or ".." in name:
        raise FileNotFoundError(f"no such checkpoint directory: {name!r}")
    from huggingface_hub import snapshot_download  # heavy import, only needed for Hub ids

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # hub/network errors come in many types; the caller needs one clear message
        reason = (str(e).strip().splitlines() or [""])[0]
        raise FileNotFoundError(
            f"{name!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {reason})"
        ) from e


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    """`eos_token_id` is an int, a list of ints or null depending on the checkpoint."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_templates(ckpt: Path, tokenizer_config: dict) -> dict[str, str]:
    """All chat templates by name ("default" is the main one); later sources override earlier ones as in HF."""
    templates: dict[str, str] = {}
    tc = tokenizer_config.get("chat_template")
    if isinstance(tc, str):
        templates["default"] = tc
    elif isinstance(tc, list):
        templates.update({t["name"]: t["template"] for t in tc})
    processor_template = _read_json(ckpt / "chat_template.json").get("chat_template")
    if isinstance(processor_template, str):
        templates["default"] = processor_template
    extra_dir = ckpt / "additional_chat_templates"
    if extra_dir.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra_dir.glob("*.jinja"))})
    if (ckpt / "chat_template.jinja").is_file():
        templates["default"] = (ckpt / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Encode/decode, special ids and chat templating for one checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        special_tokens: dict[str, str] | None = None,
        chat_templates: dict[str, str] | None = None,
        pad_token_id: int | None = None,
        name_or_path: str = "<in-memory>",
    ):
        self.backend = backend
        self.name_or_path = name_or_path
        self.special_tokens = dict(special_tokens or {})
        self.chat_templates = dict(chat_templates or {})
        eos = self.special_tokens.get("eos_token")
        ordered = ([self.token_to_id(eos)] if eos is not None else []) + list(eos_token_ids)
        ordered = [i for i in ordered if i is not None]
        # The tokenizer_config eos (the chat turn end for Qwen) is the primary one; all of them stop generation.
        self.eos_token_id: int | None = ordered[0] if ordered else None
        self.eos_token_ids: set[int] = set(ordered)
        pad = self.special_tokens.get("pad_token")
        pad_id = self.token_to_id(pad) if pad is not None else None
        self.pad_token_id: int | None = pad_id if pad_id is not None else pad_token_id
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._token_bytes: dict[int, bytes] = {}
        self._literal_backend: tokenizers.Tokenizer | None = None  # built on first encode_literal
        self._max_token_bytes: int | None = None

    @classmethod
    def from_dir(cls, ckpt: str | os.PathLike) -> "Tokenizer":
        ckpt = Path(ckpt)
        tokenizer_file = ckpt / "tokenizer.json"
        if not tokenizer_file.is_file():
            present = sorted(p.name for p in ckpt.iterdir())[:12] if ckpt.is_dir() else []
            raise FileNotFoundError(f"no tokenizer.json in {str(ckpt)!r} (found: {', '.join(present) or 'nothing'})")
        tokenizer_config = _read_json(ckpt / "tokenizer_config.json")
        config = _read_json(ckpt / "config.json")
        generation_config = _read_json(ckpt / "generation_config.json")
        eos = (
            _ids(config.get("eos_token_id"))
            + _ids((config.get("text_config") or {}).get("eos_token_id"))
            + _ids(generation_config.get("eos_token_id"))
        )
        special = {k: _token_content(tokenizer_config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        return cls(
            tokenizers.Tokenizer.from_file(str(tokenizer_file)),
            eos_token_ids=eos,
            special_tokens={k: v for k, v in special.items() if v is not None},
            chat_templates=_read_chat_templates(ckpt, tokenizer_config),
            pad_token_id=generation_config.get("pad_token_id", config.get("pad_token_id")),
            name_or_path=str(ckpt),
        )

    # --- vocabulary -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added ones included (the embedding may be padded beyond this)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_thinking(self) -> bool:
        """Whether the vocabulary has `<think>` (mlx-lm passes `enable_thinking` only then)."""
        return self.token_to_id("<think>") is not None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # --- text <-> ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (e.g. `<|im_start|>`) become their ids, as in HF."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_literal(self, text: str) -> list[int]:
        """`text` read as plain text: a special-token string in it (`<|im_end|>`) gives the tokens of its
        characters, never the control token. For user-supplied content inside a chat prompt."""
        if self._literal_backend is None:
            # a copy with the switch set: flipping it on the shared backend would race other threads' encodes
            literal = tokenizers.Tokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal_backend = literal
        return self._literal_backend.encode(text, add_special_tokens=False).ids

    @property
    def special_token_strings(self) -> tuple[str, ...]:
        """The text of every special token, longest first (so a longer one is matched before its prefix)."""
        found = (self.id_to_token(i) for i in self.special_token_ids)
        return tuple(sorted((t for t in found if t), key=len, reverse=True))

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of n bytes has at least n / this many tokens."""
        if self._max_token_bytes is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)  # not memoised per id: 250k entries
            self._max_token_bytes = max([len(_byte_level_bytes(t)) for t in vocab] + [1])
        return self._max_token_bytes

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> "StreamDetokenizer":
        """A fresh streaming detokenizer; its outputs concatenate to `decode(ids, skip_special_tokens)`."""
        if not isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel):
            raise NotImplementedError(
                f"streaming detokenization needs a byte-level BPE decoder, {self.name_or_path} has "
                f"{type(self.backend.decoder).__name__}"
            )
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        return StreamDetokenizer(self.token_bytes, skip)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the byte-level decoder turns `token_id` into (memoised: streams hit the same ids)."""
        b = self._token_bytes.get(token_id)
        if b is None:
            token = self.backend.id_to_token(token_id)
            b = b"" if token is None else _byte_level_bytes(token)  # decode() drops unknown ids too
            self._token_bytes[token_id] = b
        return b

    # --- chat ---------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        enable_thinking: bool | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` with the checkpoint template; returns ids, or the prompt when `tokenize=False`.

        `enable_thinking=None` leaves the template's default; `chat_template` is a template name
        (e.g. "tool_use") or a template source; other kwargs are template variables.
        """
        source = self._select_template(chat_template, tools)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        context = {**self.special_tokens, **kwargs}
        prompt = render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt, tools=tools, **context
        )
        # The template already wrote every special token, so nothing else may be added.
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt

    def template_source(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template source apply_chat_template would render with these arguments."""
        return self._select_template(chat_template, tools)

    def _select_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ValueError(
                f"{self.name_or_path} has named chat templates {sorted(self.chat_templates)} but no 'default'; "
                "pass chat_template=<name>"
            )
        raise ValueError(
            f"{self.name_or_path} has no chat template (looked for chat_template.jinja, chat_template.json and "
            "tokenizer_config.json 'chat_template'); pass chat_template=... or encode a raw prompt"
        )


def _bytes_to_unicode() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest shift to U+0100+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_BYTE_OF_CHAR = _bytes_to_unicode()


def _byte_level_bytes(token: str) -> bytes:
    # Same rule as the `tokenizers` ByteLevel decoder: map every char through the alphabet, and a token
    # with a char outside it (an added token like a CJK word) contributes its UTF-8 bytes unchanged.
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _utf8_complete_prefix(buf: bytearray) -> int:
    """Length of the longest prefix of `buf` whose lossy UTF-8 decoding cannot change with more bytes.

    Only a trailing lead byte still short of its continuation bytes (at most 3 bytes) is held back; cutting
    before a lead byte is always safe because a lead byte starts a fresh sequence for the decoder.
    """
    n = len(buf)
    for i in range(n - 1, max(n - 4, 0) - 1, -1):
        b = buf[i]
        if b < 0x80:
            return n  # ASCII ends any sequence; what follows it is stray continuation bytes
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
            return i if n - i < need else n
    return n  # only continuation bytes in reach: complete, or invalid either way


class StreamDetokenizer:
    """Turns a token stream into text chunks that never split a UTF-8 character.

    Works on the tokens' raw bytes, holding back at most one incomplete character, so each token costs
    O(1) and a run of literal U+FFFD (or of garbage bytes) is streamed instead of stalling the output.
    Concatenated outputs of `add` and `finish` equal the tokenizer's `decode(ids)`.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], skip_ids: frozenset[int] = frozenset()):
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._pending = bytearray()

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (often '' mid-character)."""
        if token_id in self._skip_ids:
            return ""
        self._pending += self._token_bytes(token_id)
        cut = _utf8_complete_prefix(self._pending)
        if cut == 0:
            return ""
        # errors="replace" substitutes maximal subparts, exactly like Rust's from_utf8_lossy used by decode().
        text = self._pending[:cut].decode("utf-8", errors="replace")
        del self._pending[:cut]
        return text

    def finish(self) -> str:
        """Flush what is held back (an unfinished character becomes U+FFFD, as in `decode`)."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending.clear()
        return text
