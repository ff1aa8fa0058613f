"""Chat messages -> prompt text: the checkpoint's chat template, or plain ChatML for tokenizers that
have none (the built-in demo model's byte tokenizer), and the text that continues a conversation
after a reply without re-rendering (and so re-tokenizing) what came before it.
"""

from __future__ import annotations

# Stand-in reply content (private-use code points) used to find where a template closes a reply.
SENTINEL = "\ue000mtlqwen-reply\ue001"
SENTINEL_USER = "\ue000mtlqwen-user\ue001"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


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
    if has_chat_template(tokenizer):
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
