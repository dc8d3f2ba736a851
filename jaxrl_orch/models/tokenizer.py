"""Tokenizers: the embedded byte-level default and real ``tokenizer.json`` files.

Owns text <-> id conversion for prompts and the chat template that wraps conversation turns.
Both classes share one interface (``Tokenizer``): ``encode``, ``decode``, ``vocab_size``,
``output_vocab_size`` (ids it can produce; a model's vocab may be padded past it),
``bos_id``, ``eos_id``, ``pad_id``, ``stop_ids`` and ``apply_chat_template``.

- ``ByteTokenizer``: ids 0..255 are the UTF-8 bytes; special tokens follow (``SPECIAL_TOKENS``)
  and the vocab is padded with reserved ids to ``BYTE_VOCAB_SIZE`` (= the byte model presets'
  vocab), so adding a special later does not change checkpoint shapes. Its chat template is
  ``byte_chat`` (one special id per role header, ``<|im_end|>`` closing each turn): a byte
  model pays per byte of prompt in every train and decode step, and ChatML's spelled-out
  headers cost it ~19 ids per single-turn prompt against 3 here.
- ``HFTokenizer``: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library; the
  bos/eos/pad tokens come from explicit arguments, else an adjacent ``tokenizer_config.json``,
  else well-known special-token names found in the vocab. Its chat template is the
  checkpoint's own (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``,
  rendered with jinja2 as ``transformers`` renders it: ``models/chat_template.py``); only a
  checkpoint without one falls back to a built-in layout, Llama 3 headers when the vocab has
  ``<|start_header_id|>`` and no ``<|im_start|>``, else ChatML. ``chat_template_origin``
  names which one a run uses.

Invariants: ``encode`` never adds BOS/EOS on its own (the chat template and the caller decide);
special-token strings inside text encode to their single special id, so
``encode(apply_chat_template(...))`` yields the real control ids; ``decode(encode(s)) == s``
for any string. Token ids are the engine's currency end to end (docs/design.md section 3): nothing
downstream re-tokenizes decoded text, so this module is only used at the edges (prompt in,
text out for scoring and logs). It never touches the model or devices.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from jaxrl_orch.models.chat_template import (
    ChatTemplate,
    read_tokenizer_config,
    token_str,
)
from jaxrl_orch.models.configs import BYTE_VOCAB_SIZE
from jaxrl_orch.paths import as_path

_ROLES = ("system", "user", "assistant", "tool")

# Byte tokenizer specials, in id order starting at 256. "<|im_end|>" closes a chat turn, so it
# is the EOS a chat model learns to emit (Qwen instruct convention); "<|endoftext|>" ends a
# plain document. Both are stop ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    # Role markers of the byte chat template (``byte_chat``): one id per role header.
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    output_vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str: ...


def _check_messages(messages: list[dict[str, str]]) -> None:
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; allowed roles: {_ROLES}")
        if not isinstance(m["content"], str):
            raise TypeError(f"message {i} content must be str, got {type(m['content']).__name__}")


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn (the Qwen / ChatML layout)."""
    _check_messages(messages)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def byte_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``<|role|>content<|im_end|>`` per turn: ChatML's structure with each role header a single
    special id, so a byte-level model spends 2 ids per turn on control instead of ~8 bytes."""
    _check_messages(messages)
    text = "".join(f"<|{m['role']}|>{m['content']}<|im_end|>" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def llama3_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The Llama 3 header layout (``<|start_header_id|>role<|end_header_id|>\\n\\n...``)."""
    _check_messages(messages)
    text = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
        for m in messages
    )
    if add_generation_prompt:
        text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return text


class ByteTokenizer:
    """UTF-8 bytes plus a handful of control tokens; the embedded default."""

    def __init__(self) -> None:
        self.vocab_size = BYTE_VOCAB_SIZE
        # Ids the tokenizer can produce: bytes and specials; the reserved rest is padding.
        self.output_vocab_size = 256 + len(SPECIAL_TOKENS)
        self._special_to_id = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._id_to_special = {i: tok for tok, i in self._special_to_id.items()}
        # Longest first so a special that prefixes another can never shadow it.
        alternatives = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in alternatives))
        self.pad_id = self._special_to_id["<|pad|>"]
        self.bos_id = self._special_to_id["<|bos|>"]
        self.eos_id = self._special_to_id["<|im_end|>"]
        self.endoftext_id = self._special_to_id["<|endoftext|>"]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id, self.endoftext_id)

    def token_to_id(self, token: str) -> int:
        if token not in self._special_to_id:
            raise KeyError(f"{token!r} is not a special token; known: {SPECIAL_TOKENS}")
        return self._special_to_id[token]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[start : match.start()].encode("utf-8"))
            ids.append(self._special_to_id[match.group()])
            start = match.end()
        ids.extend(text[start:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # Bytes are buffered so a multi-byte character split across ids decodes whole; a
        # sampled invalid byte sequence becomes U+FFFD rather than an exception.
        out: list[str] = []
        buf = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the byte vocab [0, {self.vocab_size})")
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens:
                out.append(self._id_to_special.get(i, f"<|reserved_{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        if tools is not None:
            raise ValueError("tools need a checkpoint's own chat template; byte_chat has none")
        return byte_chat(messages, add_generation_prompt)


_EOS_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>", "<|endoftext|>")
_STOP_CANDIDATES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` behind the ``Tokenizer`` interface."""

    def __init__(
        self,
        tokenizer,
        *,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.output_vocab_size = self.vocab_size
        self.eos_id = self._resolve("eos", eos_token, _EOS_CANDIDATES)
        bos = self._resolve("bos", bos_token, _BOS_CANDIDATES, required=False)
        self.bos_id = bos
        pad = self._resolve("pad", pad_token, _PAD_CANDIDATES, required=False)
        self.pad_id = self.eos_id if pad is None else pad
        self.chat_template = chat_template
        if chat_template is not None:
            self._template = chat_template.render
            self.chat_template_origin = chat_template.origin
        elif tokenizer.token_to_id("<|im_start|>") is None and (
            tokenizer.token_to_id("<|start_header_id|>") is not None
        ):
            self._template = llama3_chat
            self.chat_template_origin = "built-in llama3_chat (the checkpoint has none)"
        else:
            self._template = chatml
            self.chat_template_origin = "built-in chatml (the checkpoint has none)"

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ) -> HFTokenizer:
        """Load ``tokenizer.json``; specials and the chat template default to the files beside
        it (``tokenizer_config.json``, ``chat_template.jinja``). Explicit tokens win, also as
        the template's ``bos_token`` / ``eos_token`` / ``pad_token``."""
        from tokenizers import Tokenizer as _RustTokenizer

        path = as_path(path)  # local or gs://: read as text, nothing downloaded elsewhere
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {os.fspath(path)!r}")
        directory = path.parent
        cfg = read_tokenizer_config(directory)
        explicit = {"eos_token": eos_token, "bos_token": bos_token, "pad_token": pad_token}
        cfg = {**cfg, **{k: v for k, v in explicit.items() if v is not None}}
        template = ChatTemplate.from_dir(directory, cfg)
        return cls(
            _RustTokenizer.from_str(path.read_text(encoding="utf-8")),
            eos_token=token_str(cfg.get("eos_token")),
            bos_token=token_str(cfg.get("bos_token")),
            pad_token=token_str(cfg.get("pad_token")),
            chat_template=template,
        )

    def _resolve(
        self, what: str, explicit: str | None, candidates: tuple[str, ...], required: bool = True
    ) -> int | None:
        if explicit is not None:
            i = self._tok.token_to_id(explicit)
            if i is None:
                raise ValueError(f"{what} token {explicit!r} is not in the tokenizer vocab")
            return i
        for tok in candidates:
            i = self._tok.token_to_id(tok)
            if i is not None:
                return i
        if required:
            raise ValueError(
                f"cannot find a {what} token: none of {candidates} is in the vocab; pass "
                f"{what}_token= explicitly"
            )
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = [self.eos_id]
        for tok in _STOP_CANDIDATES:
            i = self._tok.token_to_id(tok)
            if i is not None and i not in ids:
                ids.append(i)
        return tuple(ids)

    def token_to_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not in the tokenizer vocab")
        return i

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """``tools`` (OpenAI's function entries) reach the checkpoint's own template only: a
        built-in layout has no place for them and refuses them."""
        _check_messages(messages)
        if tools is None:
            return self._template(messages, add_generation_prompt)
        if self.chat_template is None:
            raise ValueError(
                f"tools need the checkpoint's own chat template; this tokenizer renders with "
                f"{self.chat_template_origin}, which has no place for them"
            )
        return self.chat_template.render(messages, add_generation_prompt, tools=tools)


def load_tokenizer(spec: str | os.PathLike | None = "byte") -> ByteTokenizer | HFTokenizer:
    """``"byte"``/``None`` -> ``ByteTokenizer``; a ``tokenizer.json`` path or a directory
    holding one (e.g. an HF checkpoint directory, local or ``gs://``) -> ``HFTokenizer``."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_file(tokenizer_json_path(spec))


def tokenizer_json_path(spec: str | os.PathLike) -> str:
    """The ``tokenizer.json`` a non-byte tokenizer spec names (the file, or one in the
    directory); raises ``ValueError`` naming the spec when there is none."""
    path = as_path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"tokenizer spec {os.fspath(spec)!r} is neither 'byte' nor a tokenizer.json file "
            "nor a directory containing one"
        )
    return os.fspath(path)
