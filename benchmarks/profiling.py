"""Where a profiled stretch of wall time went, from a JAX profiler trace (``--profile DIR``).

``summarize(trace_dir)`` reads the newest ``*.xplane.pb`` under ``trace_dir`` (written by
``jax.profiler.trace``; open the same directory in TensorBoard's profile plugin or Perfetto for
the timeline) and sums, per category, each event's self time (its time minus its children's,
so nothing is counted twice and a loop that waits inside counts as waiting):

- ``device compute``: XLA executions (the CPU client's and Eigen's worker lines; on TPU/GPU the
  device planes), with the ten longest programs / fused ops by name;
- ``compile``: XLA compilation threads (a steady state should show none);
- ``transfers``: host <-> device copies (events named like ``Transfer``, ``ToLiteral``,
  ``BufferFromPyval``, ``device_put``, ``device_get``, an array's ``_value`` / ``asarray``);
  a device -> host fetch also waits for the computation behind it;
- ``waits``: Python threads blocked (``wait``, ``sleep``, ``acquire``, ``select``,
  ``block_until_ready``);
- ``host python``: every other top-level Python event (dispatch, packing, the orchestrator).

Thread categories overlap in wall time (several threads run at once), so the shares are of
summed thread time, printed next to the stretch's wall time by ``table``.
"""

from __future__ import annotations

import collections
import glob
import os
from typing import Any

_WAIT = ("wait", "sleep", "acquire", "select", "block_until_ready", "poll")
# Device -> host fetches block until the result is computed: time there is the device's.
_TRANSFER = (
    "transfer",
    "toliteral",
    "bufferfrompyval",
    "device_put",
    "device_get",
    "copy_to",
    "_value",
    "numpy asarray",
    "convert_to_numpy",
)
_MARKERS = ("end: ", "ThreadpoolListener", "ThunkExecutor::Execute (wait")


def _category(line: str, event: str) -> str | None:
    low_line, low = line.lower(), event.lower()
    if event.startswith(_MARKERS):
        return None
    if "compiler" in low_line or "codegen" in low_line or "compile" in low:
        return "compile"
    if any(k in low for k in _TRANSFER):
        return "transfers"
    if "xlapjrtcpuclient" in low_line or "xlaeigen" in low_line or line.startswith("XLA"):
        return "device compute"
    if any(k in low for k in _WAIT) or low.endswith(" get"):  # queue / future gets
        return "waits"
    return "host python"


def _self_times(events: list[Any]) -> list[tuple[str, float]]:
    """``(name, self seconds)`` per event of one thread: its time minus its children's, so a
    thread's loop that waits inside counts as waiting, not as its loop function."""
    out: list[list] = []
    stack: list[tuple[float, int]] = []  # (end_ns, index into out)
    for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        start, end = ev.start_ns, ev.start_ns + ev.duration_ns
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            out[stack[-1][1]][1] -= ev.duration_ns  # the parent's own time shrinks
        out.append([ev.name, float(ev.duration_ns)])
        stack.append((end, len(out) - 1))
    return [(name, max(ns, 0.0) / 1e9) for name, ns in out]


def summarize(trace_dir: str) -> dict[str, Any]:
    import jax

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: was the trace written?")
    data = jax.profiler.ProfileData.from_file(paths[-1])
    seconds: dict[str, float] = collections.Counter()
    programs: dict[str, float] = collections.Counter()
    host: dict[str, float] = collections.Counter()
    for plane in data.planes:
        device_plane = not plane.name.startswith("/host")
        for line in plane.lines:
            for name, secs in _self_times(list(line.events)):
                cat = "device compute" if device_plane else _category(line.name, name)
                if cat is None:
                    continue
                seconds[cat] += secs
                if cat == "device compute":
                    programs[name] += secs
                elif cat == "host python":
                    host[name] += secs
    return {
        "seconds": dict(seconds),
        "top_device": dict(collections.Counter(programs).most_common(8)),
        "top_host": dict(collections.Counter(host).most_common(8)),
        "trace": paths[-1],
    }


def table(summary: dict[str, Any], wall_s: float) -> str:
    """The summary as a small text table (seconds, and share of summed thread time)."""
    total = sum(summary["seconds"].values()) or 1.0
    rows = [f"profile over {wall_s:.2f} s wall ({summary['trace']})"]
    for cat, s in sorted(summary["seconds"].items(), key=lambda kv: -kv[1]):
        rows.append(f"  {cat:<15} {s:9.3f} s  {s / total:6.1%}")
    rows.append("  longest device programs / fused ops:")
    rows += [f"    {name[:60]:<60} {s:8.3f} s" for name, s in summary["top_device"].items()]
    rows.append("  longest host Python functions (self time):")
    rows += [f"    {name[:60]:<60} {s:8.3f} s" for name, s in summary["top_host"].items()]
    return "\n".join(rows)
