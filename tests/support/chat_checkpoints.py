"""Small checkpoint-style tokenizer directories with their own jinja chat templates (no network).

A Qwen-style one (ChatML as jinja, a default system turn, eos ``<|im_end|>``) and a
Llama-3-style one (header ids, ``bos_token`` written by the template, content trimmed): each a
tiny byte-level BPE ``tokenizer.json`` trained here with the family's special tokens, plus a
``tokenizer_config.json`` carrying the template and the bos/eos/pad tokens, as the Hub's files
do. The templates are the published ones of Qwen2.5-Instruct, Meta-Llama-3-Instruct and (without
its tool branches) Meta-Llama-3.1-Instruct, so what the tests compare against ``transformers`` is
what those checkpoints render.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxrl_orch.models.configs import ModelConfig

QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) '
    'or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Meta-Llama-3.1-Instruct's template without its tool-calling branches: a system turn with the
# knowledge and today's dates always comes first, then the trimmed turns.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    '    {%- set date_string = "26 Jul 2024" %}\n'
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    "\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    "{%- if tools is not none %}\n"
    '    {{- "Environment: ipython\\n" }}\n'
    "{%- endif %}\n"
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in "
    "message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's added tokens that its renderer (``renderers``' ``qwen3``) looks up by name.
QWEN3_SPECIALS = (
    *QWEN_SPECIALS,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
CORPUS = [
    "Reverse in <answer></answer>:",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "system user assistant the quick brown fox jumps over the lazy dog",
    "hello world, reverse the text please",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
]


def tiny_chat_config(vocab_size: int, **overrides: Any) -> ModelConfig:
    """The tests' one-layer model behind a written tokenizer: 32 wide, 2 heads over 1 KV head;
    ``overrides`` set the rest (bias, tied embeddings, context) per checkpoint family."""
    shape = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16}
    return ModelConfig(vocab_size=vocab_size, **{**shape, "d_ff": 64, **overrides})


def write_tokenizer(
    directory: Path,
    specials: tuple[str, ...],
    vocab_size: int = 300,
    corpus: tuple[str, ...] | list[str] = tuple(CORPUS),
) -> Path:
    """A byte-level BPE with ``specials`` as added special tokens, saved as tokenizer.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus) * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _write_config(directory: Path, config: dict) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_qwen_tokenizer(
    directory: Path,
    template: object = QWEN_TEMPLATE,
    specials: tuple[str, ...] = QWEN_SPECIALS,
    **bpe: Any,
) -> Path:
    """Qwen2.5-Instruct's layout: no bos, eos ``<|im_end|>``, pad ``<|endoftext|>``. ``bpe``:
    ``write_tokenizer``'s ``vocab_size`` and ``corpus``."""
    write_tokenizer(directory, specials, **bpe)
    _write_config(
        directory,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": template,
            "model_max_length": 32768,
        },
    )
    return directory


def write_qwen3_tokenizer(directory: Path) -> Path:
    """Qwen3's layout: Qwen2.5's with the tool-call, tool-response and think tokens added."""
    return write_qwen_tokenizer(directory, specials=QWEN3_SPECIALS)


def write_llama3_tokenizer(directory: Path, template: object = LLAMA31_TEMPLATE) -> Path:
    """Meta-Llama-3.1-Instruct's layout: bos ``<|begin_of_text|>`` (written by the template),
    eos ``<|eot_id|>``, no pad token."""
    write_tokenizer(directory, LLAMA3_SPECIALS)
    _write_config(
        directory,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": template,
            "model_max_length": 8192,
        },
    )
    return directory
