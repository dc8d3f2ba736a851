"""Tokenizers: byte round trips and specials, a tiny trained BPE through HFTokenizer, templates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tiny_tokenizers import write_bpe

from jaxrl_orch.models.tokenizer import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from jaxrl_orch.models.transformer import get_config

CHAT = [
    {"role": "system", "content": "Reverse the text."},
    {"role": "user", "content": "héllo ✓"},
]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_specials_and_vocab():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == get_config("tiny-byte").vocab_size == 512
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    specials = {tok.pad_id, tok.bos_id, tok.eos_id, *tok.stop_ids}
    assert all(i >= 256 for i in specials) and len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|>x<|im_end|>") == [
        tok.token_to_id("<|im_start|>"),
        120,
        tok.eos_id,
    ]
    assert len(SPECIAL_TOKENS) + 256 <= tok.vocab_size
    assert tok.decode([104, tok.eos_id, 105], skip_special_tokens=True) == "hi"
    assert tok.decode([400]) == "<|reserved_400|>"
    # A multi-byte character cut by a special still decodes; invalid bytes become U+FFFD.
    assert tok.decode([0xC3, 0xA9, tok.eos_id, 0xFF]) == "é<|im_end|>\ufffd"
    with pytest.raises(ValueError, match="outside the byte vocab"):
        tok.decode([512])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_chat_template_layout_and_special_ids():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(CHAT)
    assert text == ("<|system|>Reverse the text.<|im_end|><|user|>héllo ✓<|im_end|><|assistant|>")
    assert not tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("<|assistant|>")
    ids = tok.encode(text)
    roles = [tok.token_to_id(f"<|{r}|>") for r in ("system", "user", "assistant")]
    assert [i for i in ids if i in roles] == roles and ids.count(tok.eos_id) == 2
    # Each turn costs exactly two control ids around its UTF-8 bytes.
    assert len(ids) == len(b"Reverse the text.") + len("héllo ✓".encode()) + 5
    with pytest.raises(ValueError, match="allowed roles"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tok.apply_chat_template([{"content": "x"}])


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A tiny byte-level BPE trained here, saved as tokenizer.json + tokenizer_config.json."""
    return write_bpe(tmp_path_factory.mktemp("bpe"))


def test_hf_tokenizer_round_trip_and_specials(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert 256 + 3 < tok.vocab_size <= 320  # byte alphabet + 3 specials + learned merges
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
    assert set(tok.stop_ids) == {tok.eos_id, tok.token_to_id("<|endoftext|>")}
    for text in ["reverse the text please", "unseen wørds ✓ 123", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("reverse the text please")) < len("reverse the text please")
    ids = tok.encode(tok.apply_chat_template(CHAT))
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.eos_id) == 2
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\n")


def test_hf_tokenizer_fallbacks_and_errors(bpe_dir, tmp_path):
    # Without tokenizer_config.json the specials come from well-known names in the vocab.
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    tok = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="not in the tokenizer vocab"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json", eos_token="</s>")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        HFTokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="neither 'byte'"):
        load_tokenizer(tmp_path / "missing")
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_llama3_specials_select_the_llama3_template(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello there"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path / "tokenizer.json")
    assert hf.eos_id == hf.token_to_id("<|eot_id|>")
    assert hf.bos_id == hf.token_to_id("<|begin_of_text|>")
    text = hf.apply_chat_template(CHAT[1:])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhéllo ✓<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = hf.encode(text)
    assert ids[:2] == [hf.bos_id, hf.token_to_id("<|start_header_id|>")]
    assert hf.decode(ids) == text
