"""The byte tokenizer as an HF tokenizer directory (models/byte_hf.py): transformers, renderers
and our own loader each see exactly ``ByteTokenizer``'s ids, specials and chat layout."""

from __future__ import annotations

import pytest

from jaxrl_orch.models.byte_hf import byte_to_char, save_byte_tokenizer
from jaxrl_orch.models.tokenizer import SPECIAL_TOKENS, ByteTokenizer, byte_chat, load_tokenizer

TEXTS = [
    "Reverse: the cat sat",
    "naïve café — 日本語 🐍",
    "tabs\tand\nnewlines\r\n  leading spaces",
    "<|im_end|>inside<|user|>text<|im_end",  # specials matched, a truncated one stays bytes
    '<tool_call>{"name": "f"}</tool_call>',
    "",
]
MESSAGES = [
    {"role": "system", "content": "Reverse in <answer></answer>:"},
    {"role": "user", "content": "hello wörld"},
    {"role": "assistant", "content": "<answer>dlröw olleh</answer>"},
    {"role": "user", "content": "again"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("byte_tok"))


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_the_byte_map_is_a_bijection_onto_printable_characters():
    chars = byte_to_char()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in chars.values())


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_and_our_loader_encode_and_decode_as_the_byte_tokenizer(hf, tok_dir, text):
    ours = ByteTokenizer()
    ids = ours.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ids
    loaded = load_tokenizer(str(tok_dir))
    assert loaded.encode(text) == ids
    assert hf.decode(ids) == ours.decode(ids) == text
    assert loaded.decode(ids) == text


def test_specials_keep_their_ids_and_roles(hf):
    ours = ByteTokenizer()
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [
        ours.token_to_id(t) for t in SPECIAL_TOKENS
    ]
    assert hf.eos_token_id == ours.eos_id and hf.pad_token_id == ours.pad_id
    assert hf.bos_token_id == ours.bos_id


@pytest.mark.parametrize("generate", [True, False])
def test_the_chat_template_renders_byte_chat(hf, generate):
    want = ByteTokenizer().encode(byte_chat(MESSAGES, add_generation_prompt=generate))
    got = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=generate)
    assert list(getattr(got, "input_ids", got)) == want


def test_renderers_renders_the_embedded_default_chat(tok_dir):
    """What verifiers' training client does with a model directory: a ``renderers`` renderer
    over the tokenizer it loads there."""
    from renderers import DefaultRendererConfig, create_renderer
    from renderers.base import load_tokenizer as renderers_tokenizer

    renderer = create_renderer(renderers_tokenizer(str(tok_dir)), DefaultRendererConfig())
    rendered = renderer.render(MESSAGES, add_generation_prompt=True)
    assert rendered.token_ids == ByteTokenizer().encode(byte_chat(MESSAGES))
