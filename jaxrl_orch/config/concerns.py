"""How gin files compose: one file per concern, and no file silently undoing another.

A run is composed from one file of each concern, included side by side::

    --gin_file=configs/model/llama3.1_8b.gin --gin_file=configs/slice/v5e_8.gin \\
    --gin_file=configs/env/verifiers.gin --gin_file=configs/tune/lora.gin \\
    --gin_file=configs/algo/grpo.gin

``CONCERNS`` names the five and what each decides; ``concern_of`` says which concern owns a
setting (by its section, with the few settings that follow another concern listed in
``_OWNER``: the master weights' dtype and the learning rate follow from what is trained, the
batch and remat from the chips' memory, the completion budget from the task, the chat renderer
from the model family). What this module enforces, before gin parses anything:

- A file in a directory named after a concern (``.../slice/v5e_8.gin``, the user's own
  ``my_configs/env/math.gin`` too) binds only that concern's settings, so a slice file cannot
  quietly change the task, nor an environment file the model.
- Files side by side (the ``--gin_file`` list, or the includes of one file) that bind one
  setting to two values are refused, naming both files, both values and the setting: with gin
  alone the later file wins without a word. A file may override what it itself includes (a
  recipe refining a base), once the include is above the binding; the command line's
  ``--gin_param`` overrides everything.
- A macro some file reads (``%CHECKPOINT``) that nothing binds is refused, naming the file and
  how to bind it.

``Composition.where`` says which file bound each setting; ``config.load`` appends it to a
refusal that names settings, so a combination that cannot work (a completion budget longer
than the slice's rows) names the files it came from. Pure: reads files, no JAX, no gin state.
"""

from __future__ import annotations

import dataclasses
import re
import tokenize
from pathlib import Path

from gin import config as gin_config
from gin import config_parser

CONCERNS: dict[str, str] = {
    "model": "the network and its checkpoint (Model.*, the CHECKPOINT macro)",
    "slice": "the chips and how the run is laid out on them (Processes, Trainer, Engine)",
    "env": "the task: its environment, prompts and completion budget (Data, Verifiers)",
    "tune": "what is trained: every weight or adapters (Lora, the master dtype, learning rate)",
    "algo": "the RL algorithm and the loop around it (RL, Loss, Orchestrator, Warmup, Outputs, "
    "HarnessEval)",
}
_BY_SECTION = {
    "Model": "model",
    "Trainer": "slice",
    "Engine": "slice",
    "Processes": "slice",
    "Data": "env",
    "Verifiers": "env",
    "Lora": "tune",
    "RL": "algo",
    "Loss": "algo",
    "Orchestrator": "algo",
    "Warmup": "algo",
    "Outputs": "algo",
    "HarnessEval": "algo",
}
_OWNER = {
    "Model.param_dtype": "tune",
    "RL.learning_rate": "tune",
    "Model.remat": "slice",
    "RL.prompts_per_step": "slice",
    "RL.max_new_tokens": "env",
    "Verifiers.renderer": "model",
    "CHECKPOINT": "model",
    "VERIFIERS_ENV": "env",
}
_MACRO_READ = re.compile(r"%([A-Za-z_][\w.]*)")
_GIN_NOTE = re.compile(r"\n\s*In call to configurable .*$")
_SETTING = re.compile(r"\b([A-Z][A-Za-z]*\.[a-z_][a-z0-9_]*)\b")


def concern_of(setting: str) -> str | None:
    """The concern owning ``setting`` (``"Trainer.row_len"`` -> ``"slice"``; a macro by its
    name), or None for one no concern file may bind (``TrainConfig.seed``)."""
    if setting in _OWNER:
        return _OWNER[setting]
    return _BY_SECTION.get(setting.partition(".")[0])


@dataclasses.dataclass(frozen=True)
class Bound:
    """One binding as gin will apply it: the value's source text, and where it is."""

    setting: str
    value: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return self.file if self.file == "--gin_param" else f"{self.file}:{self.line}"


@dataclasses.dataclass
class Composition:
    """The bindings of a list of files as gin will apply them, checked (module docstring)."""

    bound: dict[str, Bound]  # setting -> the binding that wins
    reads: frozenset[str]  # every macro a file's binding reads (%NAME), overridden or not

    def where(self, setting: str) -> str | None:
        found = self.bound.get(setting)
        return None if found is None else f"{setting} = {found.value} ({found.where})"

    def explain(self, message: str) -> str:
        """``message`` plus where each setting it names was bound, if a file bound it (gin's
        own "In call to configurable" note dropped: the section is in the setting's name)."""
        message = _GIN_NOTE.sub("", message)
        named = dict.fromkeys(_SETTING.findall(message))
        lines = [w for w in map(self.where, named) if w is not None]
        return f"{message} [bound in: {'; '.join(lines)}]" if lines else message


def compose(gin_files: list[str], gin_params: list[str]) -> Composition:
    """Check ``gin_files`` compose (module docstring); the winning binding of each setting."""
    reads: set[str] = set()
    files = [(f, _file_bindings(Path(f), (), reads)) for f in gin_files]
    bound = _merge(files, "the --gin_file list")
    for param in gin_params:  # the command line overrides every file
        for statement in _statements(param, f"--gin_param {param!r}"):
            if isinstance(statement, config_parser.BindingStatement):
                setting = _name(statement)
                bound[setting] = Bound(setting, repr(statement.value), "--gin_param", 1)
    _refuse_unbound_macros(bound)
    return Composition(bound, frozenset(reads))


def _statements(text: str, where: str) -> list[object]:
    try:
        return list(config_parser.ConfigParser(text, gin_config.ParserDelegate(True)))
    except (SyntaxError, ValueError, tokenize.TokenError) as exc:
        raise ValueError(f"bad gin config in {where}: {exc}") from None


def _file_bindings(path: Path, seen: tuple[Path, ...], reads: set[str]) -> dict[str, Bound]:
    """What ``path`` binds, its includes resolved; the checks of one file. Adds the macros its
    bindings read to ``reads``."""
    if path.resolve() in seen:
        chain = " -> ".join(map(str, (*seen, path)))
        raise ValueError(f"gin file {str(path)!r} includes itself: {chain}")
    concern = path.parent.name if path.parent.name in CONCERNS else None
    own: dict[str, Bound] = {}
    includes: list[tuple[str, dict[str, Bound]]] = []
    for statement in _statements(path.read_text(), str(path)):
        line = statement.location.line_num
        if isinstance(statement, config_parser.IncludeStatement):
            inner = _file_bindings(Path(statement.filename), (*seen, path.resolve()), reads)
            _refuse_overridden(path, own, statement.filename, inner)
            includes.append((statement.filename, inner))
        elif isinstance(statement, config_parser.BindingStatement):
            setting = _name(statement)
            if concern is not None and concern_of(setting) != concern:
                raise ValueError(_foreign(path, line, setting, concern))
            own[setting] = Bound(setting, repr(statement.value), str(path), line)
            reads.update(_MACRO_READ.findall(own[setting].value))
    return {**_merge(includes, f"the includes of {str(path)!r}"), **own}


def _name(statement: config_parser.BindingStatement) -> str:
    scope = f"{statement.scope}/" if statement.scope else ""
    if not statement.arg_name:  # a macro: NAME = value
        return f"{scope}{statement.selector}"
    return f"{scope}{statement.selector}.{statement.arg_name}"


def _merge(parts: list[tuple[str, dict[str, Bound]]], what: str) -> dict[str, Bound]:
    """Side-by-side files' bindings; two that disagree on a setting are refused."""
    out: dict[str, tuple[str, Bound]] = {}
    for part, bindings in parts:
        for setting, b in bindings.items():
            if setting in out and out[setting][1].value != b.value:
                other_part, other = out[setting]
                raise ValueError(
                    f"{setting} is bound to {other.value} by {_via(other, other_part)} and to "
                    f"{b.value} by {_via(b, part)}, both in {what}: the later would silently "
                    "win. A setting belongs to one file of a composition; keep it in one, or "
                    "override it with --gin_param"
                )
            out[setting] = (part, b)
    return {setting: b for setting, (_, b) in out.items()}


def _via(b: Bound, part: str) -> str:
    return b.where if b.file == part else f"{b.where} (included by {part})"


def _refuse_overridden(
    path: Path, own: dict[str, Bound], included: str, inner: dict[str, Bound]
) -> None:
    """A binding above an include that rebinds it would be undone by the include."""
    for setting, b in own.items():
        if setting in inner and inner[setting].value != b.value:
            raise ValueError(
                f"{b.where} binds {setting} = {b.value} above `include {included!r}`, which "
                f"rebinds it to {inner[setting].value} ({inner[setting].where}) and so wins: "
                "move the include above the binding"
            )


def _foreign(path: Path, line: int, setting: str, concern: str) -> str:
    owner = concern_of(setting)
    home = f"the {owner!r} concern's ({owner}/*.gin)" if owner else "no concern's: a recipe's"
    return (
        f"{path}:{line} binds {setting}, but a file in a {concern!r} directory binds only "
        f"{CONCERNS[concern]}; {setting} is {home}, or --gin_param's"
    )


def _refuse_unbound_macros(bound: dict[str, Bound]) -> None:
    for b in bound.values():
        for macro in _MACRO_READ.findall(b.value):
            if macro in bound:
                continue
            raise ValueError(
                f"{b.where} reads %{macro}, which no gin file or binding sets: pass "
                f'--gin_param="{macro} = ..."{_MACRO_HINT.get(macro, "")}'
            )


_MACRO_HINT = {
    "CHECKPOINT": " naming the HF checkpoint directory, local or gs:// (e.g. "
    "CHECKPOINT = 'gs://BUCKET/Llama-3.1-8B-Instruct')",
}
