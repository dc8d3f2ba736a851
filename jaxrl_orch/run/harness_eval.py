"""lm-evaluation-harness tasks scored against the live policy while the run trains.

What it owns: ``HarnessEvals``, built by the RL stage when ``HarnessEval.tasks`` names tasks
(the live server, ``Engine.serve_port``, is then required). Every ``HarnessEval.every`` RL steps
it starts ``python -m lm_eval`` in a subprocess, pointed at the live server the way a user
points it at vLLM (``--model local-completions`` or ``local-chat-completions``, the run's
tokenizer as an HF directory, ``max_length`` the server's longest prompt), and goes on: the
loop never waits for it. When it exits, its scores become one row of the run's metrics at the
step it started from, ``harness/<task>/<metric>`` beside the run's own evals, with
``harness/version_first`` and ``harness/version_last``: the policy versions the run had reached
when the harness started and ended (the live server swaps weights as the trainer publishes
them, so a harness run longer than a step scores several versions; each response names its
own).

Faults: a harness run that exits non-zero or runs past ``HarnessEval.timeout_s`` (then killed)
is one console line naming its exit and its log, and counted; a due run while the last still
goes is skipped and counted. None of them stops the run. At the run's end a harness run still
going is waited for (at most its timeout) before the live server stops; after a stop signal or
a failure it is killed instead. Its files: lm-eval's output and log under
``WORKDIR/harness/step_<N>/`` (a local directory of its own for a ``gs://`` workdir).
``summary()``: runs, failed, skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl_orch.compose.engines import engine_limits
from jaxrl_orch.compose.model import tokenizer_spec
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.config.rl import HARNESS_ROUTES, HarnessEvalSettings
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.paths import is_url

LM_EVAL = (sys.executable, "-m", "lm_eval")


class HarnessEvals:
    """See the module docstring. ``url()``: the live server's (read when a harness starts);
    ``write_row(step, metrics)``: the run's metric writers; ``version()``: the policy version
    the run has reached; ``command``: lm-eval's (a test's stand-in)."""

    def __init__(
        self,
        settings: HarnessEvalSettings,
        *,
        url: Callable[[], str | None],
        model: str,
        tokenizer_dir: str,
        max_length: int,
        out_dir: Path,
        write_row: Callable[[int, dict[str, float]], None],
        version: Callable[[], int],
        command: Sequence[str] = LM_EVAL,
    ) -> None:
        self.settings = settings
        self.url = url
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.max_length = max_length
        self.out_dir = Path(out_dir)
        self.write_row = write_row
        self.version = version
        self.command = tuple(command)
        self.runs = self.failed = self.skipped = 0
        self._task: asyncio.Task[None] | None = None

    def after_step(self, step: int) -> None:
        """Start the harness when ``step`` is due (on the loop; it returns at once)."""
        if step % self.settings.every:
            return
        if self._task is not None and not self._task.done():
            self.skipped += 1
            stage("harness eval", f"step {step} skipped: the run started earlier still goes")
            return
        self._task = asyncio.get_running_loop().create_task(self._run(step))

    async def close(self, *, abort: bool = False) -> None:
        """Wait for a harness run still going (it is bounded by its own timeout); with
        ``abort``, stop it first (its lm-eval is killed)."""
        if self._task is None:
            return
        if abort:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        else:
            await self._task

    def summary(self) -> dict[str, Any]:
        return {"runs": self.runs, "failed": self.failed, "skipped": self.skipped}

    async def _run(self, step: int) -> None:
        first = self.version()
        where = self.out_dir / f"step_{step}"
        shutil.rmtree(where, ignore_errors=True)  # an earlier attempt's results are not these
        where.mkdir(parents=True)
        log = where / "lm_eval.log"
        code = await self._execute(where, log)
        self.runs += 1
        try:
            if code != 0:
                raise HarnessFailed(
                    f"ran past {self.settings.timeout_s:g} s (HarnessEval.timeout_s)"
                    if code is None
                    else f"exited {code}"
                )
            row = scores(where)
        except (HarnessFailed, OSError, ValueError, KeyError) as exc:
            self.failed += 1
            stage("harness eval", f"!! the run of step {step} {exc}; its log: {log}")
            return
        row.update({"harness/version_first": first, "harness/version_last": self.version()})
        self.write_row(step, row)
        shown = ", ".join(f"{k.removeprefix('harness/')} {v:.3f}" for k, v in row.items())
        stage("harness eval", f"step {step}: {shown}")

    async def _execute(self, where: Path, log: Path) -> int | None:
        """lm-eval's exit status, or None when it ran past the timeout (then killed)."""
        with open(log, "wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(where), stdout=out, stderr=asyncio.subprocess.STDOUT, env=_env()
            )
            try:
                return await asyncio.wait_for(proc.wait(), self.settings.timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return None
            except asyncio.CancelledError:  # the run is stopping: leave no lm-eval behind
                proc.kill()
                await proc.wait()
                raise

    def argv(self, out: Path) -> list[str]:
        s = self.settings
        args = {
            "model": self.model,
            "base_url": str(self.url()).rstrip("/") + HARNESS_ROUTES[s.model],
            "num_concurrent": s.concurrent,
            "max_length": self.max_length,
            "tokenizer_backend": "huggingface",
            "tokenizer": self.tokenizer_dir,
        }
        argv = [*self.command, "--model", s.model]
        argv += ["--model_args", ",".join(f"{k}={v}" for k, v in args.items())]
        argv += ["--tasks", ",".join(s.tasks), "--output_path", str(out)]
        if s.model == "local-chat-completions":
            argv.append("--apply_chat_template")
        if s.limit is not None:
            argv += ["--limit", str(s.limit)]
        if s.include_path is not None:
            argv += ["--include_path", s.include_path]
        return argv


class HarnessFailed(RuntimeError):
    """A harness run that did not finish with results; the message says how."""


def scores(where: Path) -> dict[str, float]:
    """``harness/<task>/<metric>`` of the results lm-eval wrote under ``where``: each number it
    reports (its ``metric,filter`` keys without the default filter ``none``), standard errors
    left out."""
    found = sorted(where.glob("*/results_*.json"))
    if not found:
        raise HarnessFailed(f"exited 0 but wrote no results_*.json under {where}")
    results = found[-1]
    row: dict[str, float] = {}
    for task, metrics in json.loads(results.read_text())["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if "_stderr" in metric or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric if kind in ("", "none") else f"{metric}/{kind}"
            row[f"harness/{task}/{name}"] = float(value)
    return row


def _env() -> dict[str, str]:
    # the live server is on loopback, whatever proxy the environment names
    return {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def harness_evals(
    parts: RunParts,
    url: Callable[[], str | None],
    version: Callable[[], int],
    write_row: Callable[[int, dict[str, float]], None],
) -> HarnessEvals | None:
    """The RL stage's harness evals, or None when ``HarnessEval.tasks`` names none. Refused
    before the stage's first rollout when lm-eval is not installed."""
    cfg = parts.cfg
    settings = cfg.harness_eval
    if not settings.tasks:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            f"HarnessEval.tasks ({list(settings.tasks)}) are scored by lm-evaluation-harness, "
            "which is not installed: pip install 'jaxrl-orch[evals]'"
        )
    # Imported when a harness runs: the verifiers adapter's module loads pydantic and aiohttp.
    from jaxrl_orch.envs.vf.env import tokenizer_dir_for

    # lm-eval reads and writes local files: a gs:// workdir's run keeps them on this host
    scratch = Path(tempfile.mkdtemp(prefix="jaxrl_orch_harness_"))
    out = scratch if is_url(parts.workdir) else Path(parts.workdir) / "harness"
    return HarnessEvals(
        settings,
        url=url,
        model=cfg.model.name,
        tokenizer_dir=tokenizer_dir_for(tokenizer_spec(cfg.model), scratch),
        max_length=engine_limits(cfg).max_prefill_length,
        out_dir=out,
        write_row=write_row,
        version=version,
    )
