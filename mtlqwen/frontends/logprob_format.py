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

    def echoed(self, ids: list[int], lps: list | None) -> dict:
        """The completions `logprobs` of an echoed prompt: every prompt token, the first (and every one when the
        prompt's logprobs were not computed) with null logprob and alternatives."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, t in enumerate(ids):
            lp = lps[i] if lps else None
            text = self.text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob if lp else None)
            out["top_logprobs"].append({self.text(a): v for a, v in reversed(lp.top)} if lp else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def joined(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}

    def completion(self, lps: list) -> dict:
        """TokenLogprobs -> the completions `logprobs` object; text offsets continue from the previous call's."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            if lp is None:
                continue
            text = self.text(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.text(t): v for t, v in reversed(lp.top)})  # the likelier of a shared text
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
