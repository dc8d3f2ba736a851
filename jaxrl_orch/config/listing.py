"""What ``python -m jaxrl_orch.train`` tells a newcomer: every setting, and the shipped configs.

``--list_config`` prints every setting, grouped by section (``RL``, ``Loss``, ``Engine``, ...),
each as ``Section.name: type = default`` with what it may hold (``allowed: >= 1``) and its
meaning: exactly the name a gin binding uses. All three come from the field's own declaration
(``jaxrl_orch.settings.setting``), the one the section's check reads, so the listing and the
check cannot disagree and a new field is listed without touching this file. A field that holds
a section (``RL.loss``) is listed as that section, after its parent.

``configs_help`` lists ``configs/*.gin`` (next to the package in a checkout, absent from an
installed wheel) with the first sentence of each file's leading comment, for the message the
command prints when it is run without a gin file.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

from jaxrl_orch.config.concerns import CONCERNS
from jaxrl_orch.config.section import sections_of
from jaxrl_orch.settings import allowed_of, meaning_of, section_name

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
WIDTH = 100


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str
    type: str
    default: str  # repr of the default, as a gin binding would spell it
    meaning: str
    allowed: str | None = None  # what the section's check lets it hold (None: any of its type)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def field_docs(cls: type, prefix: str = "") -> list[FieldDoc]:
    """One entry per setting of ``cls`` (not its nested sections), in declaration order."""
    nested = {name for name, _ in sections_of(cls)}
    docs = []
    for f in dataclasses.fields(cls):
        if f.name in nested:
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rule = allowed_of(f)
        docs.append(
            FieldDoc(
                prefix + f.name,
                kind,
                _default(f),
                meaning_of(f),
                None if rule is None else str(rule),
            )
        )
    return docs


def _groups(cls: type) -> list[tuple[str, list[FieldDoc]]]:
    """``[(section name, its settings)]`` of each section under ``cls``, depth first."""
    out = []
    for _, section in sections_of(cls):
        name = section_name(section)
        out.append((name, field_docs(section, prefix=f"{name}.")))
        out.extend(_groups(section))
    return out


def format_config_listing(cls: type | None = None) -> str:
    """The ``--list_config`` text: a header, then each section's settings under its heading,
    each as ``Section.name: type = default`` with what it may hold and its meaning below."""
    if cls is None:
        from jaxrl_orch.config.train import TrainConfig

        cls = TrainConfig
    name = section_name(cls)
    groups = [(name, field_docs(cls, prefix=f"{name}."))] + _groups(cls)
    count = sum(len(docs) for _, docs in groups)
    out = [
        f"{name}: {count} settings, shown with their built-in defaults (configs/*.gin "
        "override some).",
        f"Set one with --gin_param='{groups[min(1, len(groups) - 1)][0]}.NAME = VALUE', or with "
        "that line in a gin file.",
    ]
    for heading, docs in groups:
        out.extend(["", f"[{heading}]"])
        out.extend(_entry_lines(docs))
    return "\n".join(out)


def _entry_lines(docs: list[FieldDoc]) -> list[str]:
    out: list[str] = []
    for d in docs:
        out.append(f"  {d.name}: {d.type} = {d.default}")
        if d.allowed:
            out.append(f"    allowed: {d.allowed}")
        if d.meaning:
            out.extend(_wrap(d.meaning))
    return out


def _wrap(text: str, max_lines: int | None = None) -> list[str]:
    indent = " " * 6
    # whole words only: a value such as 'local-chat-completions' is copied into gin bindings
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent,
        max_lines=max_lines,
        break_on_hyphens=False,
    )


def _summary(path: Path) -> str:
    """The first sentence of the file's leading comment paragraph ("" when it has none)."""
    words: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text:
            if words:
                break
            continue
        words.append(text)
    para = " ".join(words)
    return re.split(r"(?<=[.!?])\s", para, maxsplit=1)[0]


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (the form to type)."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def configs_help(configs_dir: Path | None = None) -> list[str]:
    """Lines listing ``configs_dir/*.gin`` (default ``CONFIGS_DIR``) with a summary each; a note
    when there are none."""
    configs_dir = CONFIGS_DIR if configs_dir is None else configs_dir
    files = sorted(configs_dir.glob("*.gin")) if configs_dir.is_dir() else []
    if not files:
        return [
            f"(no gin files at {configs_dir}: an installed package does not ship them; they are "
            "in the repository's configs/ directory)"
        ]
    lines = [f"The shipped configs ({shown(configs_dir)}/):"]
    for f in files:
        summary = _summary(f)
        lines.append(f"  {shown(f)}")
        if summary:
            lines.extend(_wrap(summary, max_lines=2))  # a pointer; the file says the rest
    concerns = [c for c in CONCERNS if (configs_dir / c).is_dir()]
    if concerns:
        lines.append("Or compose a run from one --gin_file of each concern:")
    for concern in concerns:
        names = ", ".join(p.stem for p in sorted((configs_dir / concern).glob("*.gin")))
        lines.append(f"  {shown(configs_dir / concern)}/: {names}")
    return lines
