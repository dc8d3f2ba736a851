"""The byte tokenizer as a Hugging Face tokenizer directory: what outside tools load it as.

``save_byte_tokenizer(path)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` so that
``transformers.AutoTokenizer``, ``renderers`` (verifiers' training client renders chats with it)
and this package's ``HFTokenizer`` all see the embedded default's tokenizer exactly:

- ids 0-255 are the UTF-8 bytes: a byte-level BPE with no merges, each byte its own token under
  GPT-2's byte-to-character map (the ``ByteLevel`` pre-tokenizer and decoder, no regex split, no
  prefix space), so any text encodes to its bytes;
- ids 256 on are ``tokenizer.SPECIAL_TOKENS`` in order, as special added tokens (matched in the
  text before the bytes, as ``ByteTokenizer.encode`` does);
- the chat template is ``byte_chat``'s layout in Jinja (``<|role|>content<|im_end|>`` per turn,
  ``<|assistant|>`` to generate), with ``<|im_end|>`` the end-of-sequence token.

The ids past the specials (``BYTE_VOCAB_SIZE`` rounds the model's rows up) are padding rows the
model never samples (``ModelConfig.output_vocab``), so the tokenizer has no token for them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxrl_orch.models.tokenizer import SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (what ``ByteLevel``
    uses): printable Latin-1 bytes map to themselves, the rest to code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {}
    extra = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_byte_tokenizer(path: str | os.PathLike) -> Path:
    """Write the byte tokenizer's HF files into ``path`` (created); returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != 256 + i:
            raise AssertionError(f"special token {t!r} got id {tok.token_to_id(t)}, not {256 + i}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
