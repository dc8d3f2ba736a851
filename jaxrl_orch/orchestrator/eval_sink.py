"""EvalSink: eval episodes -> one ``EvalBatch`` of per-env metrics per (eval step, env).

What it owns: collecting the eval rollouts of each scheduled evaluation and summarising them.
No tokenization, no advantages, no filters: eval rollouts are measured, never trained on.

Protocol (driven by the orchestrator's main loop):

1. ``expect(step, env, n)`` when an evaluation of ``n`` rollouts of ``env`` is scheduled for
   train step ``step`` (before its rollouts can arrive).
2. ``add(episode)`` for every eval episode. The episode is assigned to the step its
   rollouts name in ``Rollout.eval_step`` (the dispatcher stamps it), or, for rollouts with
   ``eval_step is None``, to the oldest open expectation for that env (expectations of one env
   complete in order). When the ``n``-th rollout of an expectation arrives, ``add`` returns
   its ``EvalBatch``; otherwise ``None``.

Metrics per batch (``eval/<env>/...``): ``rollouts`` (n), ``errors`` (rollouts with an error),
``nonfinite_rewards``, and over the scored rollouts (no error, finite reward): ``reward_mean``,
``reward_std``, ``pass_rate`` (fraction with ``reward >= PASS_THRESHOLD``, a full score) and
``model_tokens_mean``, plus ``behaviour/<name>`` for every per-rollout metric an env labels
that way (one-hot labels, so the mean is that behaviour's share of the scored answers).
Errored rollouts are kept out of the reward statistics and reported in ``errors`` instead, so
a crashing environment shows up as crashes, not as a low score; the statistics are absent when
nothing was scored.

Invariants: every eval rollout lands in exactly one batch; an episode never straddles two
expectations (an episode larger than what an expectation still awaits raises, naming both
counts); a rollout that no expectation awaits raises rather than being silently dropped. It
never imports another orchestrator component and never writes metrics itself.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl_orch.orchestrator.stats import behaviour_shares
from jaxrl_orch.types import Episode, EvalBatch, Rollout, has_nonfinite_reward

# An eval rollout passes when its reward reaches this: a full score.
PASS_THRESHOLD = 1.0


class _Expectation:
    __slots__ = ("step", "env", "n", "rollouts")

    def __init__(self, step: int, env: str, n: int) -> None:
        self.step = step
        self.env = env
        self.n = n
        self.rollouts: list[Rollout] = []

    @property
    def remaining(self) -> int:
        return self.n - len(self.rollouts)


def eval_metrics(
    env: str, rollouts: list[Rollout], pass_threshold: float = PASS_THRESHOLD
) -> dict[str, float]:
    """The per-env summary of one evaluation (see the module docstring for the keys)."""
    p = f"eval/{env}/"
    errors = sum(r.has_error for r in rollouts)
    nonfinite = sum(has_nonfinite_reward(r) for r in rollouts)
    scored = [r for r in rollouts if not r.has_error and math.isfinite(r.reward)]
    m = {p + "rollouts": float(len(rollouts)), p + "errors": float(errors)}
    m[p + "nonfinite_rewards"] = float(nonfinite)
    if scored:
        rewards = np.array([r.reward for r in scored], np.float64)
        m[p + "reward_mean"] = float(rewards.mean())
        m[p + "reward_std"] = float(rewards.std())
        m[p + "pass_rate"] = float((rewards >= pass_threshold).mean())
        m[p + "model_tokens_mean"] = float(np.mean([r.num_model_tokens for r in scored]))
        m.update({p + k: v for k, v in behaviour_shares(scored).items()})
    return m


class EvalSink:
    def __init__(self) -> None:
        self._open: dict[tuple[int, str], _Expectation] = {}
        self._running = False
        self._batches = 0
        self._rollouts = 0

    def start(self) -> None:
        """No background work: ``add`` does everything. Kept for the component contract."""
        self._running = True

    def stop(self) -> None:
        self._running = False

    def expect(self, step: int, env: str, n: int) -> None:
        """Announce that eval step ``step`` will produce ``n`` rollouts of ``env``."""
        if n < 1:
            raise ValueError(f"expected eval rollout count must be >= 1, got n={n!r}")
        key = (int(step), env)
        if key in self._open:
            raise ValueError(f"eval of env {env!r} at step {step} is already expected")
        self._open[key] = _Expectation(int(step), env, int(n))

    def add(self, episode: Episode) -> EvalBatch | None:
        """Take one eval episode; return the ``EvalBatch`` it completes, if any."""
        if not episode:
            raise ValueError("episode must hold at least one rollout, got an empty list")
        env = episode[0].env
        for r in episode:
            if not r.is_eval:
                raise ValueError(
                    f"train rollout (env={r.env!r}, group_id={r.group_id}) sent to the eval "
                    "sink; route only is_eval episodes here"
                )
            if r.env != env:
                raise ValueError(f"one episode mixes envs {env!r} and {r.env!r}")
        exp = self._find(episode)
        if len(episode) > exp.remaining:
            raise ValueError(
                f"eval episode of {len(episode)} rollouts for env {env!r} step {exp.step}, but "
                f"only {exp.remaining} of the expected {exp.n} are still awaited"
            )
        exp.rollouts.extend(episode)
        self._rollouts += len(episode)
        if exp.remaining:
            return None
        del self._open[(exp.step, exp.env)]
        self._batches += 1
        return EvalBatch(
            step=exp.step,
            env=exp.env,
            rollouts=exp.rollouts,
            metrics=eval_metrics(exp.env, exp.rollouts),
        )

    def _find(self, episode: Episode) -> _Expectation:
        env = episode[0].env
        tagged = {r.eval_step for r in episode if r.eval_step is not None}
        if len(tagged) > 1:
            raise ValueError(f"one eval episode names several steps: {sorted(tagged)}")
        if tagged:
            key = (int(tagged.pop()), env)
            if key not in self._open:
                raise ValueError(
                    f"eval rollouts for env {env!r} step {key[0]} arrived, but that evaluation "
                    f"is not expected; open: {sorted(self._open)} (call expect() first)"
                )
            return self._open[key]
        candidates = [e for e in self._open.values() if e.env == env]
        if not candidates:
            raise ValueError(
                f"eval rollouts for env {env!r} arrived with no open expectation; open: "
                f"{sorted(self._open)} (call expect(step, env, n) before dispatching)"
            )
        return min(candidates, key=lambda e: e.step)

    def pending(self) -> dict[tuple[int, str], int]:
        """Rollouts still awaited per open (step, env)."""
        return {k: e.remaining for k, e in self._open.items()}

    def gauges(self) -> dict[str, float]:
        return {
            "eval_sink/open_evals": float(len(self._open)),
            "eval_sink/awaited_rollouts": float(sum(e.remaining for e in self._open.values())),
            "eval_sink/batches_total": float(self._batches),
            "eval_sink/rollouts_total": float(self._rollouts),
            "eval_sink/running": float(self._running),
        }
