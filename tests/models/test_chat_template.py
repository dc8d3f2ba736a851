"""A checkpoint's own chat template renders exactly as ``transformers.apply_chat_template``
renders it from the same files: text and ids, for Qwen- and Llama-3-style checkpoints, named
template lists, ``chat_template.jinja``, and the template helpers (sandbox included)."""

from __future__ import annotations

import json

import pytest
import transformers  # the dev extra has it: a missing one fails, never skips
from support.chat_checkpoints import (
    LLAMA3_TEMPLATE,
    QWEN_TEMPLATE,
    write_llama3_tokenizer,
    write_qwen_tokenizer,
)

from jaxrl_orch.models.chat_template import ChatTemplate, find_chat_template
from jaxrl_orch.models.tokenizer import HFTokenizer, chatml, llama3_chat, load_tokenizer

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Reverse in <answer></answer>:\nhello world"}],
    "system_user": [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "héllo ✓ wörld  "},
    ],
    "multi_turn": [
        {"role": "system", "content": "You reverse text."},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "<answer>xof nworb kciuq eht</answer>"},
        {"role": "user", "content": "now: lazy dog\n"},
    ],
}
WRITERS = {
    "qwen": write_qwen_tokenizer,
    "llama3": lambda d: write_llama3_tokenizer(d, template=LLAMA3_TEMPLATE),
    "llama3.1": write_llama3_tokenizer,
}


def _hf(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _hf_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request, tmp_path_factory):
    directory = WRITERS[request.param](tmp_path_factory.mktemp(request.param.replace(".", "_")))
    return request.param, directory, load_tokenizer(directory), _hf(directory)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_text_and_ids_equal_transformers(checkpoint, conversation, add_generation_prompt):
    family, directory, ours, hf = checkpoint
    messages = CONVERSATIONS[conversation]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == want
    assert ours.encode(text) == _hf_ids(hf, messages, add_generation_prompt)
    assert ours.chat_template_origin == str(directory / "tokenizer_config.json")


def test_the_checkpoints_template_is_used_not_the_built_in_layout(checkpoint):
    family, _, ours, _ = checkpoint
    # Qwen's template adds its default system turn; Llama 3's trims each turn's content (and
    # Llama 3.1's always opens with a dated system turn).
    messages = CONVERSATIONS["user_only" if family == "qwen" else "system_user"]
    built_in = chatml if family == "qwen" else llama3_chat
    assert ours.apply_chat_template(messages) != built_in(messages)
    ids = ours.encode(ours.apply_chat_template(messages))
    if family.startswith("llama3"):
        assert ids[0] == ours.bos_id == ours.token_to_id("<|begin_of_text|>")
        assert ours.eos_id == ours.token_to_id("<|eot_id|>") and ids.count(ours.eos_id) == 2
    else:
        assert ours.bos_id is None and ids[0] == ours.token_to_id("<|im_start|>")
        assert ours.eos_id == ours.token_to_id("<|im_end|>") and ids.count(ours.eos_id) == 2


def test_named_templates_use_default(tmp_path):
    named = [
        {"name": "tool_use", "template": "{{ 'tools!' }}"},
        {"name": "default", "template": QWEN_TEMPLATE},
    ]
    write_qwen_tokenizer(tmp_path / "ok", template=named)
    ours, hf = load_tokenizer(tmp_path / "ok"), _hf(tmp_path / "ok")
    for messages in CONVERSATIONS.values():
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == want
    write_qwen_tokenizer(tmp_path / "bad", template=named[:1])
    with pytest.raises(ValueError, match=r"named templates \['tool_use'\] but none is named"):
        load_tokenizer(tmp_path / "bad")


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    write_qwen_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_TEMPLATE.replace("bos_token", "'>>'"))
    ours, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    messages = CONVERSATIONS["multi_turn"]
    text = ours.apply_chat_template(messages)
    assert text.startswith(">><|start_header_id|>system")
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.chat_template_origin == str(tmp_path / "chat_template.jinja")


# Every helper transformers gives a template, in one template.
FEATURES = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{%- continue -%}{%- endif -%}"
    "{%- if loop.index > 3 -%}{%- break -%}{%- endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{%- if m.role == 'assistant' -%}{% generation %}[{{ m.content }}]{% endgeneration %}"
    "{%- else -%}{{ m.role }}={{ m | tojson }};{%- endif -%}"
    "{%- endfor -%}"
    "{{ '' }}\n    {% if ns.n %}lstripped{% endif %}\n;"  # lstrip_blocks, then trim_blocks
    "{{ dict(a=1, b='<&>') | tojson }}|{{ ns.n }}|{{ eos_token }}|{{ bos_token }}|"
    "{{ tools is none }}|{{ strftime_now('%Y') }}"
    "{%- if messages[-1].content == 'boom' -%}{{ raise_exception('no boom, got ' + "
    "messages[-1].role) }}{%- endif -%}"
    "{%- if add_generation_prompt %}\n  <gen>\n{% endif %}"
)


def test_template_helpers_match_transformers(tmp_path):
    write_qwen_tokenizer(tmp_path, template=FEATURES)
    ours, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    messages = [
        {"role": "system", "content": "é <b>"},
        {"role": "tool", "content": "skipped"},
        {"role": "user", "content": 'say "hi"'},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "after the break"},
    ]
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
    assert '"é <b>"' in want and '"<&>"' in want  # tojson does not escape
    assert "\nlstripped;" in want
    boom = [{"role": "user", "content": "boom"}]
    with pytest.raises(Exception, match="no boom, got user"):
        hf.apply_chat_template(boom, tokenize=False)
    with pytest.raises(ValueError, match=r"tokenizer_config.json refused .*no boom, got user"):
        ours.apply_chat_template(boom)


def test_the_sandbox_refuses_internals():
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", origin="evil.json")
    with pytest.raises(ValueError, match="evil.json refused"):
        escape.render([{"role": "user", "content": "x"}])
    underscore = ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}", origin="t")
    with pytest.raises(ValueError, match="underscore attribute '_x'"):
        underscore.render([])


def test_bad_templates_are_named(tmp_path):
    write_qwen_tokenizer(tmp_path, template="{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat template does not compile"):
        load_tokenizer(tmp_path)
    write_qwen_tokenizer(tmp_path, template=7)
    with pytest.raises(ValueError, match="chat_template must be a string, a list"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="unknown special token names"):
        ChatTemplate("x", {"bos": "<s>"})


def test_without_a_template_the_built_in_layouts_stay(tmp_path):
    write_qwen_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert find_chat_template(tmp_path) is None
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None and "built-in chatml" in tok.chat_template_origin
    messages = CONVERSATIONS["multi_turn"]
    assert tok.apply_chat_template(messages) == chatml(messages)


def test_explicit_tokens_reach_the_template(tmp_path):
    write_llama3_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(tmp_path / "tokenizer.json", bos_token="<|end_of_text|>")
    text = tok.apply_chat_template(CONVERSATIONS["user_only"])
    assert text.startswith("<|end_of_text|><|start_header_id|>system")
    assert tok.bos_id == tok.token_to_id("<|end_of_text|>")
    with pytest.raises(ValueError, match="allowed roles"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature_c": 21}'},
]


def test_tools_and_tool_turns_render_as_transformers_renders_them(tmp_path):
    directory = write_qwen_tokenizer(tmp_path / "qwen")
    ours, hf = load_tokenizer(directory), _hf(directory)
    text = ours.apply_chat_template(TOOL_TURNS, add_generation_prompt=True, tools=TOOLS)
    want = hf.apply_chat_template(
        TOOL_TURNS, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == want
    assert "<tools>" in text and '"arguments": {"city": "Paris"}' in text
    assert "<tools>" not in ours.apply_chat_template(TOOL_TURNS, add_generation_prompt=True)


def test_a_built_in_layout_refuses_tools(tmp_path):
    directory = write_qwen_tokenizer(tmp_path / "qwen", template=None)
    with pytest.raises(ValueError, match="own chat template"):
        load_tokenizer(directory).apply_chat_template(TOOL_TURNS[:1], tools=TOOLS)
