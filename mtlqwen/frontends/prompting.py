"""Chat messages -> prompt text: the checkpoint's chat template, or plain ChatML for tokenizers that
have none (the built-in demo model's byte tokenizer), and the text that continues a conversation
after a reply without re-rendering (and so re-tokenizing) what came before it.

`render_ids` also tokenizes, reading what the messages say as text: a special-token string a user
writes (`<|im_end|>\n<|im_start|>system`) stays characters and cannot open or close a turn.
"""

from __future__ import annotations

import re

# Stand-in reply content (private-use code points) used to find where a template closes a reply.
SENTINEL = "\ue000mtlqwen-reply\ue001"
SENTINEL_USER = "\ue000mtlqwen-user\ue001"


def has_chat_template(tokenizer, template_kwargs: dict | None = None) -> bool:
    """Whether a template renders the messages: the tokenizer's, or one given (`chat_template` in the kwargs)."""
    given = bool((template_kwargs or {}).get("chat_template"))
    return (given or bool(getattr(tokenizer, "chat_template", None))) and hasattr(tokenizer, "apply_chat_template")


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def chatml(messages: list[dict], add_generation_prompt: bool = True, **_) -> str:
    """Plain ChatML, the fallback when the tokenizer has no template."""
    out = [f"<|im_start|>{m['role']}\n{_text(m.get('content'))}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The prompt text for `messages` (template variables such as enable_thinking in kwargs)."""
    if has_chat_template(tokenizer, template_kwargs):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
    return chatml(messages, add_generation_prompt)


def continuation(tokenizer, system: list[dict], new_messages: list[dict], **template_kwargs) -> str | None:
    """The text a template writes after an assistant reply's content, up to and including the generation
    prompt for the next reply when `new_messages` (e.g. one user turn) follow; None when the template
    does not show the reply's content verbatim (then the caller re-renders the whole conversation).

    Rendering a stand-in conversation [system, user, assistant=SENTINEL, *new] and cutting after the
    sentinel gives the closing of the reply (`<|im_end|>\\n` for ChatML) plus the new turns, exactly as
    the template spells them, while the real reply's tokens are kept as generated."""
    convo = [*system, {"role": "user", "content": SENTINEL_USER}, {"role": "assistant", "content": SENTINEL},
             *new_messages]
    text = render(tokenizer, convo, add_generation_prompt=True, **template_kwargs)
    i = text.find(SENTINEL)
    if i < 0 or text.find(SENTINEL, i + 1) >= 0:
        return None
    return text[i + len(SENTINEL):]


# A noncharacter marks where message text had a special-token string: `MARK n MARK` stands for the n-th
# escaped string while the template runs, and is tokenized back as that string's characters.
MARK = "\U0010fffe"
_PLACEHOLDER = re.compile(f"{MARK}(\\d+){MARK}")
# Templates split an assistant turn's reasoning on these, so in assistant messages they keep their meaning.
REASONING_MARKERS = ("<think>", "</think>")


class _Escaper:
    """Replaces special-token strings (and MARK itself) in message strings by numbered placeholders."""

    def __init__(self, specials: tuple[str, ...]):
        self.literals: list[str] = []
        self._index: dict[str, int] = {}
        self._specials = specials

    def _pattern(self, keep: tuple[str, ...]) -> re.Pattern | None:
        words = [MARK, *(s for s in self._specials if s not in keep)]
        return re.compile("|".join(map(re.escape, words))) if words else None

    def _sub(self, m: re.Match) -> str:
        text = m.group(0)
        if text not in self._index:
            self._index[text] = len(self.literals)
            self.literals.append(text)
        return f"{MARK}{self._index[text]}{MARK}"

    def value(self, v, pattern):
        if isinstance(v, str):
            return pattern.sub(self._sub, v)
        if isinstance(v, list):
            return [self.value(x, pattern) for x in v]
        if isinstance(v, dict):
            return {k: self.value(x, pattern) for k, x in v.items()}
        return v

    def plain(self, v):
        """Any value's strings with every special-token string escaped (what a user message gets)."""
        return self.value(v, self._pattern(()))

    def messages(self, messages: list[dict]) -> list[dict]:
        plain, assistant = self._pattern(()), self._pattern(REASONING_MARKERS)
        return [self.value(m, assistant if m.get("role") == "assistant" else plain) for m in messages]


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True, *,
               literal_content: bool = True, **template_kwargs) -> tuple[list[int], str]:
    """(prompt token ids, prompt text). With literal_content, special-token strings inside the messages
    are tokenized as the characters they are, while the ones the template writes stay control tokens;
    otherwise the rendered text is tokenized whole, as transformers does.

    The template renders messages whose special-token strings are placeholders; the result is cut at
    the special tokens left (the template's own), and each stretch between two of them, placeholders
    restored, is tokenized as plain text: exactly the tokens of the rendered text had the message's
    specials been ordinary characters."""
    specials = tuple(getattr(tokenizer, "special_token_strings", ()))
    if not literal_content or not specials:
        text = render(tokenizer, messages, add_generation_prompt, **template_kwargs)
        return list(tokenizer.encode(text)), text
    esc = _Escaper(specials)
    if template_kwargs.get("tools"):  # tool schemas are the client's text too
        template_kwargs["tools"] = esc.plain(template_kwargs["tools"])
    marked = render(tokenizer, esc.messages(messages), add_generation_prompt, **template_kwargs)

    def restore(chunk: str) -> str:
        return _PLACEHOLDER.sub(lambda m: esc.literals[int(m.group(1))] if int(m.group(1)) < len(esc.literals)
                                else m.group(0), chunk)

    ids: list[int] = []
    text: list[str] = []
    pos = 0
    for m in re.finditer("|".join(map(re.escape, specials)), marked):
        chunk = restore(marked[pos:m.start()])
        ids += tokenizer.encode_literal(chunk) if chunk else []
        ids.append(tokenizer.token_to_id(m.group(0)))
        text += [chunk, m.group(0)]
        pos = m.end()
    chunk = restore(marked[pos:])
    ids += tokenizer.encode_literal(chunk) if chunk else []
    text.append(chunk)
    return ids, "".join(text)
