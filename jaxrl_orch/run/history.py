"""The run's history on disk: trimmed on resume so every step appears once, and read back whole.

What it owns
- ``trim_for_rl(workdir, start_step, eval_at_start)``: before the RL stage writes anything, rows
  of an earlier attempt that the resumed run will produce again are removed:
  ``metrics.jsonl`` RL rows (every row without ``sft/`` keys) at steps ``>= start_step`` and,
  when the resumed run re-evaluates its first weights, the eval rows of step
  ``start_step - 1``; ``gauges.jsonl`` rows at steps ``>= start_step``; stored rollouts
  (``rollouts/step_*.jsonl``) of steps ``>= start_step``. A run killed after step 5 and
  restored from step 3 so reads steps 1..3 once, then 4, 5, ... once each.
- ``trim_for_sft(workdir, done)``: the same for warm-up rows past the restored SFT step.
- ``check_history(workdir)``: those files read once at start, so a damaged line (not UTF-8,
  not JSON, or not a row: an object with an integer ``step``) fails the command before any
  work, naming the file, the line and what is wrong.
- ``BeforeRLRecorder``: a metrics writer that records ``eval_before_rl.json`` as soon as the
  step-0 eval lands (not at the end of the run), so a crash later keeps it.
- ``rl_evals(workdir)`` / ``rl_step_rows(workdir)``: the eval metrics per step and the step
  rows of the whole RL stage, read from ``metrics.jsonl``, so a resumed run's summary covers
  every attempt, not only the last one; ``rl_summary`` builds the RL keys of ``summary.json``
  from them.

Rewrites are atomic (``paths.write_atomic``, local or ``gs://``); a torn last line (a kill -9
in the middle of a write) is dropped. The files' writers open lazily, so trimming happens
before anything of this attempt is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.orchestrator.loop import Orchestrator
from jaxrl_orch.paths import Pathish, as_path, write_atomic
from jaxrl_orch.run.summary import eval_summary, first_eval, train_reward_ends

Row = dict[str, Any]


def read_rows(path: Pathish) -> list[Row]:
    """The rows of ``path`` (none if it does not exist), each a JSON object with an integer
    ``step``. A torn last line (a write cut short by a crash: no newline after it, and not
    UTF-8 or not JSON) is dropped; any other bad line is an error naming the file, the line and
    what is wrong with it."""
    path = as_path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    # Each row is written whole with its newline: only a last line without one can be torn.
    torn = len(lines) - 1 if lines[-1].strip() else None
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw.decode("utf-8")))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
            if i == torn:
                break
            what = _unreadable(raw, exc)
            raise ValueError(f"{path} line {i + 1} {what}; fix or delete the line") from None
        wrong = _not_a_row(rows[-1])
        if wrong:
            raise ValueError(f"{path} line {i + 1} {wrong}; fix or delete the line")
    return rows


def _unreadable(raw: bytes, exc: ValueError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    return f"is not JSON ({exc})"


_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
ROW = 'a row is an object with an integer "step"'


def _not_a_row(value: Any) -> str:
    """What keeps ``value`` from being a row ('' when it is one)."""
    if not isinstance(value, dict):
        kind = _JSON_TYPES.get(type(value), "a number")
        return f"is {kind}, not a row ({ROW})"
    if "step" not in value:
        return f'has no "step" ({ROW})'
    step = value["step"]
    number = isinstance(step, int | float) and not isinstance(step, bool)
    if not (number and math.isfinite(step) and step == int(step)):
        return f'has "step": {json.dumps(step)} ({ROW})'
    return ""


def check_history(workdir: Pathish) -> None:
    """Read the workdir's row files a resume will trim (``ValueError`` naming the file, the
    line and what is wrong with it), so a damaged file fails the command at start, not the RL
    stage."""
    for name in ("metrics.jsonl", "gauges.jsonl"):
        read_rows(as_path(workdir) / name)


def _rewrite(path: Pathish, keep: Callable[[Row], bool]) -> int:
    path = as_path(path)
    rows = read_rows(path)
    kept = [r for r in rows if keep(r)]
    if len(kept) == len(rows) and (not path.exists() or _ends_clean(path)):
        return 0
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(rows) - len(kept)


def _ends_clean(path: epath.Path) -> bool:
    text = path.read_bytes()
    return not text or text.endswith(b"\n")


def is_sft_row(row: Mapping[str, Any]) -> bool:
    return any(k.startswith("sft/") for k in row)


def _is_eval_row(row: Mapping[str, Any]) -> bool:
    return any(k.startswith("eval/") for k in row)


def trim_for_rl(workdir: Pathish, start_step: int, eval_at_start: bool) -> dict[str, int]:
    """See the module docstring; returns how many rows / files each kind lost."""
    workdir = as_path(workdir)

    def keep_metric(r: Row) -> bool:
        if is_sft_row(r):
            return True
        step = int(r["step"])
        if step >= start_step:
            return False
        return not (eval_at_start and step == start_step - 1 and _is_eval_row(r))

    dropped = {
        "metrics": _rewrite(workdir / "metrics.jsonl", keep_metric),
        "gauges": _rewrite(workdir / "gauges.jsonl", lambda r: int(r["step"]) < start_step),
        "rollout_files": 0,
    }
    store = workdir / "rollouts"
    if store.is_dir():
        for f in store.glob("step_*.jsonl"):
            if int(f.stem.split("_")[1]) >= start_step:
                f.unlink()
                dropped["rollout_files"] += 1
    return dropped


def trim_for_sft(workdir: Pathish, done: int) -> int:
    """Drop warm-up rows past step ``done`` (the restored SFT checkpoint's)."""
    path = as_path(workdir) / "metrics.jsonl"
    return _rewrite(path, lambda r: not (is_sft_row(r) and int(r["step"]) > done))


def rl_rows(workdir: Pathish) -> list[Row]:
    return [r for r in read_rows(as_path(workdir) / "metrics.jsonl") if not is_sft_row(r)]


def rl_evals(workdir: Pathish) -> dict[int, dict[str, float]]:
    """``{step: eval metrics}`` of every eval row of the RL stage on disk."""
    out: dict[int, dict[str, float]] = {}
    for r in rl_rows(workdir):
        evals = {k: v for k, v in r.items() if k.startswith("eval/") and v is not None}
        if evals:
            out.setdefault(int(r["step"]), {}).update(evals)
    return out


def rl_step_rows(workdir: Pathish) -> list[Row]:
    """The per-step rows (those with ``train/reward_mean``), in step order."""
    rows = [r for r in rl_rows(workdir) if r.get("train/reward_mean") is not None]
    return sorted(rows, key=lambda r: int(r["step"]))


class BeforeRLRecorder:
    """A ``MetricsWriter``: writes ``path`` (``eval_before_rl.json``) once step 0's evals of
    ``env`` land, updated as the sampled eval lands too. Other rows are ignored."""

    def __init__(self, path: Pathish, env: str, sampled_env: str) -> None:
        self.path = as_path(path)
        self.env = env
        self.sampled_env = sampled_env
        self._evals: dict[int, dict[str, float]] = {}

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step != 0 or not _is_eval_row(metrics):
            return
        self._evals.setdefault(0, {}).update(metrics)
        first = first_eval(self._evals, self.env, self.sampled_env)
        if first is not None:
            write_atomic(self.path, json.dumps(first))

    def close(self) -> None:
        pass


def rl_summary(
    wd: Pathish,
    cfg: TrainConfig,
    env_names: tuple[str, str],
    orch: Orchestrator,
    steps: tuple[int, int, float],
) -> dict[str, Any]:
    """The RL keys of ``summary.json``: evals and train rewards of every attempt (from disk),
    the warm-up's eval as first recorded, this attempt's ages, drops and env errors.
    ``env_names``: the greedy and the sampled eval's; ``steps``: the last trained version, this
    attempt's first step and its seconds."""
    wd = as_path(wd)
    version, start, secs = steps
    before_path = wd / "eval_before_rl.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else {}
    return {
        **eval_summary(rl_evals(wd), *env_names, before),
        "eval_temperature": cfg.rl.temperature,
        "rl_steps": version,
        "rl_steps_this_run": version - (start - 1),
        "resumed_from_step": start - 1 if start > 1 else None,
        "rl_seconds": secs,
        **train_reward_ends(rl_step_rows(wd)),
        "age_histogram": {str(k): v for k, v in sorted(orch.age_histogram.items())},
        "age_policy": cfg.orchestrator.age_policy,
        "dropped": orch.dropped_total,
        "env_errors": orch.faults.digest(),
        "rollouts": rollout_counts(orch),
    }


def rollout_counts(orch: Orchestrator) -> dict[str, int]:
    """This attempt's rollouts: dispatched, handed to the sinks (each exactly once), failed,
    cancelled, those the train sink saw, and those it kept out of training by why
    (``untrainable``: a cut rollout's finish reason, or ``other``)."""
    d = orch.dispatcher.gauges()
    s = orch.train_sink.gauges()
    kinds = {
        k.split("/")[2].removesuffix("_total"): int(v)
        for k, v in s.items()
        if k.startswith("train_sink/untrainable/")
    }
    return {
        "dispatched": int(d["dispatcher/admitted_total"] + d["dispatcher/eval_admitted_total"]),
        "reached_sinks": int(d["dispatcher/emitted_total"]),
        "errors": int(d["dispatcher/errors_total"]),
        "cancelled": int(d["dispatcher/cancelled_total"]),
        "train_sink_seen": int(s["train_sink/rollouts_seen_total"]),
        "untrainable": kinds,
    }
