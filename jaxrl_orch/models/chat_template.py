"""A checkpoint's own chat template (jinja2), rendered the way ``transformers`` renders it.

What it owns: finding the template a Hugging Face checkpoint ships and turning a conversation
into prompt text with it.

- ``find_chat_template(directory)``: ``chat_template.jinja`` when present (transformers gives
  that file priority), else ``tokenizer_config.json``'s ``chat_template``: a string, or a list
  of ``{"name", "template"}`` entries (or a name -> template dict) of which "default" is used.
  None when the checkpoint has no template (the caller falls back to a built-in layout).
- ``ChatTemplate(source, special_tokens, origin)``: compiled once, up front, so a broken
  template fails at load naming its file, not at the first prompt. ``render(messages,
  add_generation_prompt)`` gives the text ``transformers``' ``apply_chat_template(...,
  tokenize=False)`` gives for the same files.

The environment mirrors ``transformers.utils.chat_template_utils``: an
``ImmutableSandboxedEnvironment`` (templates are untrusted code from the checkpoint) with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block
that renders its body (transformers uses it only to track assistant-token masks), the globals
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing ``namespace``, and a
``tojson`` filter that does not HTML-escape. Render variables: ``messages``,
``add_generation_prompt``, ``tools`` (None, or OpenAI's ``{"type": "function", "function": {...}}``
entries as given, as ``transformers`` passes them), ``documents=None`` and the named special tokens
(``bos_token``, ``eos_token``, ``pad_token``, ...) present in the config, as strings. A template
that calls ``raise_exception`` raises ``ValueError`` naming its origin.

It never touches the model, devices or the tokenizer's ids: encoding the text is the
tokenizer's job (``models/tokenizer.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from jaxrl_orch.paths import as_path

# The named special tokens transformers passes to a template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
DEFAULT_NAME = "default"


def token_str(value: object) -> str | None:
    """A special token as stored in ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``directory`` as a dict; ``{}`` when there is none."""
    path = as_path(directory) / CONFIG_FILE  # local or gs://: a checkpoint's own directory
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens a config sets, as the strings a template sees."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        tok = token_str(config.get(name))
        if tok is not None:
            out[name] = tok
    return out


def select_template(value: Any, origin: str) -> str:
    """The template string of a ``chat_template`` config value (see the module docstring)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
                raise ValueError(
                    f"{origin}: chat_template entry {i} must be a dict with 'name' and "
                    f"'template', got {entry!r}"
                )
            named[entry["name"]] = entry.get("template")
        value = named
    if isinstance(value, dict):
        if DEFAULT_NAME not in value:
            raise ValueError(
                f"{origin}: chat_template holds named templates {sorted(value)} but none is "
                f"named {DEFAULT_NAME!r}, the one a run uses"
            )
        chosen = value[DEFAULT_NAME]
        if not isinstance(chosen, str):
            raise ValueError(
                f"{origin}: the {DEFAULT_NAME!r} chat_template must be a string, got "
                f"{type(chosen).__name__}"
            )
        return chosen
    raise ValueError(
        f"{origin}: chat_template must be a string, a list of {{'name', 'template'}} entries "
        f"or a dict of named templates, got {type(value).__name__}"
    )


def find_chat_template(
    directory: str | os.PathLike, config: Mapping[str, Any] | None = None
) -> tuple[str, str] | None:
    """``(template, origin)`` a checkpoint directory ships, or None (see the module docstring).
    ``config`` is its already-read ``tokenizer_config.json``, if the caller has it."""
    jinja_path = as_path(directory) / TEMPLATE_FILE
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), os.fspath(jinja_path)
    if config is None:
        config = read_tokenizer_config(directory)
    value = config.get("chat_template")
    if value is None:
        return None
    origin = os.fspath(as_path(directory) / CONFIG_FILE)
    return select_template(value, origin), origin


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # ``{% generation %}...{% endgeneration %}`` marks assistant text for transformers'
        # assistant-token masks; the text itself renders unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # Underscore attributes on a namespace could reach CPython internals.
        def __init__(*args, **kwargs):
            self = args[0]
            args = args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the underscore attribute {name!r}"
                )

    class DictBuiltin:
        # ``dict(...)`` and ``dict.fromkeys(...)`` without exposing the type itself.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=DictBuiltin(),
        namespace=Namespace,
    )
    return env


class ChatTemplate:
    """A compiled checkpoint chat template with the special tokens it renders."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "<str>"
    ) -> None:
        import jinja2

        if not isinstance(source, str) or not source:
            raise ValueError(f"{origin}: chat template must be a non-empty string, got {source!r}")
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        bad = sorted(set(self.special_tokens) - set(SPECIAL_TOKEN_NAMES))
        if bad:
            raise ValueError(f"unknown special token names {bad}; known: {SPECIAL_TOKEN_NAMES}")
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(
                f"{origin}: chat template does not compile (line {exc.lineno}: {exc.message})"
            ) from exc

    @classmethod
    def from_dir(
        cls, directory: str | os.PathLike, config: Mapping[str, Any] | None = None
    ) -> ChatTemplate | None:
        """The template a checkpoint directory ships with its config's special tokens, or None."""
        if config is None:
            config = read_tokenizer_config(directory)
        found = find_chat_template(directory, config)
        if found is None:
            return None
        source, origin = found
        return cls(source, special_tokens_of(config), origin)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        import jinja2

        try:
            return self._compiled.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            msg = f"chat template {self.origin} refused the conversation: {exc}"
            raise ValueError(msg) from exc
