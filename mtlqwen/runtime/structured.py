"""Structured outputs: a reply held to a grammar (a JSON schema, a regular expression, a choice of strings, a
Lark grammar) by masking, before each sample, every token that cannot continue it. llguidance computes the
masks from the tokenizer's vocabulary; one matcher a constrained sequence follows the tokens it has produced.

When a mask is needed. A mask for a sequence's next token needs its previous token on the host, so while a
constrained sequence runs the engine reads each step back before building the next (Constraints.must_sync):
the one-step lag of pipelining is given up for those steps. `Structure.after` delays the constraint until a
given token has been produced (the end of a thinking block: a reasoning model thinks freely, then answers in
the grammar's form). When the grammar is complete the sequence finishes ("stop"). A constrained request never
drafts (SamplingParams.drafts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

FORMATS = ("json_schema", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class Structure:
    """format: one of FORMATS; text: the JSON schema (its JSON text), the regex, a JSON list of strings, or the
    Lark grammar; after: a token id the reply must produce before the constraint starts (None: from the start)."""

    format: str
    text: str
    after: int | None = None

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"structured format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not isinstance(self.text, str) or not self.text or len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured text must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.after is not None and (isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0):
            raise ValueError(f"structured after must be a token id, got {self.after!r}")

    def grammar(self) -> str:
        """llguidance's grammar for it; ValueError naming what is wrong with the text."""
        import llguidance  # noqa: PLC0415 (the engine imports this module whether or not a request is constrained)

        try:
            if self.format == "json_schema":
                # fixed separators: a model's whitespace between tokens is the classic way JSON mode never ends
                g = llguidance.LLMatcher.grammar_from_json_schema(json.loads(self.text),
                                                                  overrides={"whitespace_flexible": False})
            else:
                if self.format == "choice":
                    choices = json.loads(self.text)
                    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                        raise ValueError("a choice is a JSON list of strings")
                g = llguidance.grammar_from(self.format, self.text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured {self.format}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g)
        if is_error:
            raise ValueError(f"structured {self.format}: {messages[0]}")
        return g


class Constraints:
    """The engine's matchers: one per constrained live sequence, compiled when it is submitted (a bad grammar is
    the submitter's error) and used from the moment its constraint starts."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None
        self.matchers: dict = {}  # Sequence -> llguidance.LLMatcher
        self.waiting: dict = {}  # Sequence -> its matcher, until its Structure.after token comes
        self._executor = None  # llguidance.LLExecutor, for the masks of several rows at once

    def _llt(self):
        if self._lltok is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise ValueError("structured outputs need a checkpoint tokenizer (tokenizer.json)")
            import llguidance  # noqa: PLC0415

            self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)
        return self._lltok

    def _new_matcher(self, structure: Structure):
        import llguidance  # noqa: PLC0415

        m = llguidance.LLMatcher(self._llt(), structure.grammar(), log_level=0)
        if m.is_error():
            raise ValueError(f"structured {structure.format}: {m.get_error()}")
        return m

    def matcher(self, structure: Structure):
        """At submit, before the request exists: its compiled matcher, or ValueError when the grammar cannot be
        used."""
        structure.validate()
        return self._new_matcher(structure)

    def admit(self, seq, matcher) -> None:
        """The submitted sequence and the matcher `matcher()` compiled for it."""
        (self.matchers if seq.params.structured.after is None else self.waiting)[seq] = matcher

    def must_sync(self, flight_sampling) -> bool:
        """Whether the step in flight samples a constrained sequence, whose next mask needs that token."""
        return any(s.seq in self.matchers or s.seq in self.waiting for s in flight_sampling)

    def masks(self, sampling) -> tuple[list[int], mx.array] | None:
        """The step's constrained rows and their allowed tokens [P, V] bool; None when no row is constrained."""
        rows = [r for r, s in enumerate(sampling) if s.seq in self.matchers]
        if not rows:
            return None
        W = (self.vocab_size + 31) // 32
        bits = np.zeros((len(rows), W), dtype=np.int32)
        matchers = [(self.matchers[sampling[r].seq], i) for i, r in enumerate(rows)]
        if len(matchers) == 1:
            bits[0] = np.frombuffer(matchers[0][0].compute_bitmask(), dtype=np.int32)[:W]
        else:  # llguidance's threads, the GIL released: the masks of a batch side by side
            import llguidance.numpy  # noqa: PLC0415

            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bits)
        b = mx.array(bits.view(np.uint32))
        allowed = ((b[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1).reshape(len(rows), W * 32)
        return rows, allowed[:, : self.vocab_size] > 0

    def consume(self, seq, tok: int) -> bool:
        """A token the sequence produced; True when its grammar is now complete (the reply ends there)."""
        if seq in self.waiting:
            if tok == seq.params.structured.after:
                self.matchers[seq] = self.waiting.pop(seq)
            return False
        m = self.matchers.get(seq)
        if m is None:
            return False
        m.consume_token(tok)
        return m.is_stopped() and not m.is_error()

    def release(self, seq) -> None:
        self.matchers.pop(seq, None)
        self.waiting.pop(seq, None)


def apply_masks(logits: mx.array, masks: tuple[list[int], mx.array] | None) -> mx.array:
    """logits [R, V] -> the same with the constrained rows' disallowed tokens at -inf."""
    if masks is None:
        return logits
    rows, allowed = masks
    keep = mx.ones(logits.shape, dtype=mx.bool_)
    keep[mx.array(rows, dtype=mx.int32)] = allowed
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))
