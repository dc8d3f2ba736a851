"""What a run's workdir says, read for the report: metrics lines, the summary, and the series,
ages and behaviour shares taken from them.

What it owns: reading ``WORKDIR/metrics.jsonl`` (one JSON object per line, as the JSONL metrics
writer appends them) and ``WORKDIR/summary.json`` (end-of-run facts: ``eval_reward_before_rl``,
``eval_reward_final``, ``rl_steps``, ``wall_seconds``, ``age_histogram`` as ``{age: count}``,
``max_staleness``, ``behaviour`` as ``{mode: {eval step: {behaviour: share}}}``), and the views
``plots`` and ``report`` share: numeric series per key, the eval keys, the age histogram and
bound, the behaviour shares (with their words, ``BEHAVIOURS``).

Invariants: a line is classified by its ``"kind"`` (``train``/``eval``/``sft``), else by its
keys (``sft/loss``; ``eval/<env>/...``; ``train/``, ``orch/``, ``time/``). Non-numeric values
(bools included) and NaN gauges are gaps, never points. Malformed input raises
``ReportInputError`` (a ``ValueError``) naming the file (and line); a missing ``metrics.jsonl``
``FileNotFoundError``. Reads through ``paths`` (``gs://`` too); never recomputes facts the run
owns (ages, rewards).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl_orch.paths import as_path

# behaviour -> (legend words, meaning in the report); unknown behaviours are shown by name.
BEHAVIOURS = {
    "full": ("full reversal", "the full character reversal (the rewarded behaviour)"),
    "word_order": ("word order reversed", "words in reverse order spelled forwards"),
    "no_tags": ("no answer tags", "no answer tags (scores 0)"),
    "other": ("other", "anything else"),
}

_TRAIN_PREFIXES = ("train/", "orch/", "time/")


class ReportInputError(ValueError):
    """A metrics or summary file that is not shaped as this module expects."""


def json_object(text: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{where}: not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise ReportInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a metrics JSONL file; blank lines are ignored, anything else must be an object."""
    path = as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    with path.open() as f:
        return [json_object(line, f"{path}:{i}") for i, line in enumerate(f, 1) if line.strip()]


def read_summary(workdir: str | Path) -> dict[str, Any]:
    """``WORKDIR/summary.json``, or ``{}`` while the run has not written it yet."""
    path = as_path(workdir) / "summary.json"
    return json_object(path.read_text(), str(path)) if path.is_file() else {}


def num(v: Any) -> float | None:
    """A finite-or-NaN float for numeric values; None for anything else (bools included)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def series(records: Sequence[dict], key: str, x_key: str = "step") -> tuple[list, list]:
    pairs = [(num(r.get(x_key)), num(r.get(key))) for r in records]
    # NaN gauges (a step with nothing to measure) are gaps, not points.
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None and math.isfinite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def split_records(records: Sequence[dict]) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """``(sft, rest, evals, train)``; ``rest`` is every line that is not SFT."""
    is_kind = lambda r, kind, by_keys: r["kind"] == kind if r.get("kind") is not None else by_keys
    sft = []
    rest = []
    for r in records:
        (sft if r.get("kind") == "sft" or "sft/loss" in r else rest).append(r)
    # Without a kind, one line may carry both a step's training gauges and its eval results.
    evals = [r for r in rest if is_kind(r, "eval", bool(eval_keys([r])))]
    train = [r for r in rest if is_kind(r, "train", any(k.startswith(_TRAIN_PREFIXES) for k in r))]
    return sft, rest, evals, train


def eval_keys(records: Sequence[dict]) -> list[str]:
    ends = ("/reward_mean", "/sampled_reward_mean")
    return sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith(ends)})


def age_histogram(summary: dict) -> dict[int, int] | None:
    raw = summary.get("age_histogram")
    if not isinstance(raw, dict) or not raw:
        return None
    try:
        return {int(age): int(count) for age, count in raw.items()}
    except (TypeError, ValueError) as e:
        raise ReportInputError(f"summary.json age_histogram is not {{age: count}}: {e}") from e


def staleness_bound(summary: dict) -> float | None:
    b = num(summary.get("max_staleness"))
    if b is None and isinstance(summary.get("config"), dict):
        b = num(summary["config"].get("max_staleness"))
    return b


def behaviour_shares(summary: dict) -> tuple[dict[str, dict[int, dict]], list[str]] | None:
    """``({mode words: {step: {behaviour: share}}}, behaviour names)``, greedy first."""
    if not summary.get("behaviour"):
        return None
    t = num(summary.get("eval_temperature"))
    words = {} if t is None else {"sampled": f"sampled T={t:g}"}
    try:
        shares = {
            words.get(m, m): {int(s): {b: float(v) for b, v in by.items()} for s, by in st.items()}
            for m, st in sorted(summary["behaviour"].items(), key=lambda kv: kv[0] != "greedy")
        }
    except (AttributeError, TypeError, ValueError) as e:
        raise ReportInputError(
            f"summary.json behaviour is not {{mode: {{step: shares}}}}: {e}"
        ) from e
    seen = {b for st in shares.values() for by in st.values() for b in by}
    return shares, [b for b in BEHAVIOURS if b in seen] + sorted(seen - set(BEHAVIOURS))
