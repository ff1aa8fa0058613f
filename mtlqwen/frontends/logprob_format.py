"""Logprobs (runtime/logprobs.py's TokenLogprob) in OpenAI's two shapes: chat's `logprobs.content` (one entry
a token: its text, logprob, UTF-8 bytes and top alternatives) and the legacy completions' parallel lists
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's text is its bytes decoded on their own:
a token that splits a character shows U+FFFD there, and its `bytes` let a client join them back.
"""

from __future__ import annotations

from typing import Callable


class LogprobFormat:
    def __init__(self, tokenizer):
        self.token_bytes: Callable[[int], bytes] = getattr(tokenizer, "token_bytes", None) or (
            lambda i: tokenizer.decode([i]).encode("utf-8"))
        self.offset = 0  # characters of completion text before the next token (completions' text_offset)

    def text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

    def chat(self, lps: list) -> dict:
        """TokenLogprobs -> chat's `logprobs` object."""
        return {"content": [{**self._entry(lp.token, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps if lp is not None]}

    def _legacy(self, pairs) -> dict:
        """(token, TokenLogprob or None) pairs -> the completions' parallel lists; text offsets continue from the
        previous call's. A token without a logprob (an echoed prompt's first) has null logprob and alternatives;
        of two alternatives sharing a text (bytes of a split character) the likelier is listed."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in pairs:
            text = self.text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob if lp else None)
            out["top_logprobs"].append({self.text(a): v for a, v in reversed(lp.top)} if lp else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def echoed(self, ids: list[int], lps: list | None) -> dict:
        """The completions `logprobs` of an echoed prompt, every token (null logprobs where none were computed)."""
        return self._legacy((t, lps[i] if lps else None) for i, t in enumerate(ids))

    def completion(self, lps: list) -> dict:
        """TokenLogprobs of generated tokens -> the completions `logprobs` object."""
        return self._legacy((lp.token, lp) for lp in lps if lp is not None)

    @staticmethod
    def joined(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}
