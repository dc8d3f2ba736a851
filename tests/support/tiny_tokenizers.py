"""A tiny byte-level BPE ``tokenizer.json`` trained on the spot (no network), for tests that
need a real HF tokenizer file: the tokenizer tests and the HF-checkpoint run test."""

from __future__ import annotations

import json
from pathlib import Path


def write_bpe(directory: Path) -> Path:
    """Train a 320-id BPE with ChatML specials; write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["reverse the text please", "hello world", "the quick brown fox"] * 50
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}})
    )
    return directory
