"""Split a streamed completion into reasoning (inside <think>...</think>) and the answer.

Qwen3.5 templates open the thinking block in the generation prompt, so the completion starts inside
it and the model closes it with `</think>`; other models write `<think>` themselves. Text that could
be the start of a tag is held back until it cannot be, so a tag split across deltas is still found.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside a thinking block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.started = in_reasoning  # a completion may open <think> itself only at its very start
        self.strip_newlines = False  # the answer after </think> starts after the template's blank line
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """New text -> (reasoning, content) that is now certain."""
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if not self.started:
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf = head[len(OPEN):]
                    self.in_reasoning = self.started = True
                    continue
                if OPEN.startswith(head):
                    break  # could still become <think>
                self.started = True
            if self.in_reasoning:
                i = self.buf.find(CLOSE)
                if i < 0:
                    keep = _partial_suffix(self.buf, CLOSE)
                    reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                reasoning += self.buf[:i]
                self.buf = self.buf[i + len(CLOSE):]
                self.in_reasoning, self.strip_newlines = False, True
                continue
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.strip_newlines = False
            content += self.buf
            self.buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the completion: whatever was held back is final."""
        rest, self.buf = self.buf, ""
        if self.in_reasoning:
            return rest, ""
        return "", rest.lstrip("\n") if self.strip_newlines else rest


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The whole completion at once -> (reasoning, content)."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.feed("")
    r3, c3 = s.finish()
    return (r1 + r2 + r3).strip("\n"), c1 + c2 + c3
