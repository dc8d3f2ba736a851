"""What ``python -m jaxrl_orch.train`` tells a newcomer: every setting, and the shipped configs.

``--list_config`` prints every setting, grouped by section (``RL``, ``Engine``, ...), each as
``Section.name: type = default`` with what it may hold (``allowed: >= 1``, read from the
section's ``ALLOWED`` table, the one its own check uses: ``config.checks``) and its meaning:
exactly the name a gin binding uses. The
field set comes from ``dataclasses.fields`` (a field whose default is a dataclass is a section,
listed field by field under its heading), so a new field is listed without touching this file;
the meanings are read from the comments in the class's own source (``inspect`` + ``tokenize``),
so ``config/train.py`` stays the one place a setting is documented:

- a trailing ``# ...`` on the field's line is that field's meaning;
- a block of comment lines directly above a field is printed above it as written.

Without the source (a build that ships only ``.pyc``) the listing still has every field, its
type and default; only the meanings are missing.

``configs_help`` lists ``configs/*.gin`` (next to the package in a checkout, absent from an
installed wheel) with the first sentence of each file's leading comment, for the message the
command prints when it is run without a gin file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

from jaxrl_orch.config.checks import allowed_of

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
WIDTH = 100


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str
    type: str
    default: str  # repr of the default, as a gin binding would spell it
    comment: str | None  # the trailing comment on the field's line(s)
    above: tuple[str, ...]  # comment lines directly above the field, without the "# "
    allowed: str | None = None  # what the section's check lets it hold (None: unchecked here)


def _comments(cls: type) -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """``{field: (trailing comment, comment lines above)}`` from ``cls``'s source; {} without it."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    trailing: dict[int, str] = {}  # 1-based line -> comment after code on that line
    standalone: dict[int, str] = {}  # 1-based line -> a line that is only a comment
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        text = tok.string.lstrip("#").strip()
        if lines[row - 1][:col].strip():
            trailing[row] = text
        else:
            standalone[row] = text
    [classdef] = [n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)]
    out: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        after = [trailing[r] for r in range(node.lineno, end + 1) if r in trailing]
        above: list[str] = []
        row = node.lineno - 1
        while row in standalone:  # stops at a blank line or code
            above.insert(0, standalone[row])
            row -= 1
        out[node.target.id] = (" ".join(after) or None, tuple(above))
    return out


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def field_docs(cls: type, prefix: str = "") -> list[FieldDoc]:
    """One entry per field of ``cls``, in declaration order, named ``prefix + name``."""
    comments: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for klass in reversed(cls.__mro__):  # a subclass's comment on a field wins over its base's
        if dataclasses.is_dataclass(klass):
            comments.update(_comments(klass))
    allowed = allowed_of(cls)
    docs = []
    for f in dataclasses.fields(cls):
        comment, above = comments.get(f.name, (None, ()))
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rule = str(allowed[f.name]) if f.name in allowed else None
        docs.append(FieldDoc(prefix + f.name, kind, _default(f), comment, above, rule))
    return docs


def _section(f: dataclasses.Field) -> type | None:
    """The section class a field holds (its default is built by a dataclass), else None."""
    factory = f.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
        return factory
    return None


def format_config_listing(cls: type | None = None) -> str:
    """The ``--list_config`` text: a header, then each field as ``name: type = default`` with
    its meaning indented below it and any comment block above it kept in place; a section's
    fields come under its heading as ``Section.name``."""
    if cls is None:
        from jaxrl_orch.config.train import TrainConfig

        cls = TrainConfig
    name = cls.__name__
    plain = [f for f in dataclasses.fields(cls) if _section(f) is None]
    sections = [s for f in dataclasses.fields(cls) if (s := _section(f)) is not None]
    groups = [(name, [d for d in field_docs(cls) if d.name in {f.name for f in plain}])]
    groups += [(s.__name__, field_docs(s, prefix=f"{s.__name__}.")) for s in sections]
    count = sum(len(docs) for _, docs in groups)
    example = f"{sections[0].__name__}.NAME" if sections else f"{name}.NAME"
    out = [
        f"{name}: {count} settings, shown with their built-in defaults (configs/*.gin "
        "override some).",
        f"Set one with --gin_param='{example} = VALUE', or with that line in a gin file.",
    ]
    for heading, docs in groups:
        if sections:
            out.extend(["", f"[{heading}]"])
        out.extend(_entry_lines(docs))
    return "\n".join(out)


def _entry_lines(docs: list[FieldDoc]) -> list[str]:
    out: list[str] = []
    for d in docs:
        if d.above:
            out.append("")
            out.extend(f"  # {line}" for line in d.above)
        out.append(f"  {d.name}: {d.type} = {d.default}")
        if d.allowed:
            out.append(f"    allowed: {d.allowed}")
        if d.comment:
            out.extend(_wrap(d.comment))
    return out


def _wrap(text: str, max_lines: int | None = None) -> list[str]:
    indent = " " * 6
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent, max_lines=max_lines
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
    return lines
