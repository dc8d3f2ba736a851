"""A finished verifiers episode -> one ``Rollout``, exactly, or an error naming what is off.

What it owns: ``episode_rollout(episode, replies, **fields)``. A verifiers trace is a graph of
message nodes; each root-to-leaf ``Branch`` is one training sequence (``token_ids``, the sampled
``mask``, the sampled tokens' log-probs per node). Here:

- every node with sampled tokens must equal one engine reply of the trace's session: the same
  ids and the same log-probs, bit for bit. That reply's per-token policy versions go onto the
  node's sampled tokens (verifiers keeps none). A node equal to no reply, or equal in ids but not
  in log-probs, raises ``TraceMismatch`` naming the node, its length and the session; no span is
  ever guessed.
- the first trainable branch fills the rollout's own trace; each further one becomes a
  ``types.Branch``. A node already placed on an earlier branch is context on the later ones
  (``loss_mask`` False), so a shared node trains once.
- any reply of the session the engine ended short (``finish_reason`` "abort", which verifiers
  reads as none) leaves the rollout untrainable (``envs.base.cut_fields``), whether or not a
  node matched it: a reply cut before its first token has no node to match;
- the reward is the trace's (its weighted sum); each named reward is a ``reward/<name>`` metric
  and each named metric a ``metric/<name>`` one, next to the turn metrics every env reports; the
  sinks average both into the train and eval rows (``orchestrator.stats.LABELS``).

An episode that did not conclude (an error on the episode or the trace, a stage timeout, no
trace, or a multi-agent episode with more than one trainable trace) raises ``EpisodeFailed``; the
dispatcher turns either exception into an error rollout, counted, never trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.envs.base import check_reward, cut_fields, turn_metrics
from jaxrl_orch.types import NO_VERSION, Branch, Completion, Rollout


class TraceMismatch(ValueError):
    """A trace's sampled span that equals no engine reply of its session."""


class EpisodeFailed(RuntimeError):
    """A verifiers episode that ended in an error, a timeout or without a trainable trace."""


def episode_rollout(episode: Any, replies: Sequence[Completion], **fields: Any) -> Rollout:
    """The rollout of ``episode`` and the session's ``replies`` (see the module docstring),
    built whole; ``fields``: the rest of ``Rollout``'s (its env, ids and sampling)."""
    trace = _the_trace(episode)
    paths = trace_paths(trace, replies)
    first, *more = paths
    rollout = Rollout(
        token_ids=first.token_ids,
        loss_mask=first.loss_mask,
        logprobs=first.logprobs,
        versions=first.versions,
        branches=more,
        reward=check_reward(trace.reward, env=fields["env"]),
        num_turns=len(trace.calls),
        metrics={**turn_metrics(replies), **_trace_metrics(trace)},
        **cut_fields(replies),
        **fields,
    )
    rollout.validate_trace()
    return rollout


def _the_trace(episode: Any) -> Any:
    if episode.errors:
        raise EpisodeFailed(f"verifiers episode failed: {_errors(episode.errors)}")
    trainable = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if len(trainable) != 1:
        raise EpisodeFailed(
            f"verifiers episode has {len(trainable)} trainable traces; a rollout takes exactly "
            "one (multi-agent episodes are not trained yet)"
        )
    (trace,) = trainable
    if trace.is_timeout:  # the cause, when scoring a cut-off trace failed too
        raise EpisodeFailed(f"verifiers trace {trace.id} timed out ({trace.stop_condition})")
    if trace.errors:
        raise EpisodeFailed(f"verifiers trace {trace.id} failed: {_errors(trace.errors)}")
    return trace


def _errors(errors: Sequence[Any]) -> str:
    return "; ".join(f"{getattr(e, 'type', 'Error')}: {getattr(e, 'message', e)}" for e in errors)


def trace_paths(trace: Any, replies: Sequence[Completion]) -> list[Branch]:
    """Each trainable branch of ``trace`` as a token path with versions (module docstring)."""
    placed: set[int] = set()  # nodes already on an earlier path (by identity)
    unused = list(range(len(replies)))
    paths = []
    for branch in trace.branches:
        if not branch.trainable:
            continue
        path = Branch([], [], [], [])
        for node in branch.nodes:
            train = id(node) not in placed and any(node.mask)
            versions = _match(node, replies, unused, trace.id) if train else None
            _append(path, node, versions)
            placed.add(id(node))
        paths.append(path)
    if not paths:
        raise EpisodeFailed(f"verifiers trace {trace.id} has no trainable branch")
    return paths


def _append(path: Branch, node: Any, versions: list[int] | None) -> None:
    """The node's tokens onto ``path``: trained (with ``versions``) or as context."""
    lps = iter(node.logprobs or [])
    vers = iter(versions or [])
    for token, sampled in zip(node.token_ids, node.mask, strict=True):
        lp = _float(next(lps, None)) if sampled else 0.0
        train = bool(sampled) and versions is not None
        path.token_ids.append(int(token))
        path.loss_mask.append(train)
        path.logprobs.append(lp if train else 0.0)
        path.versions.append(next(vers) if train else NO_VERSION)


def _match(node: Any, replies: Sequence[Completion], unused: list[int], session: str) -> list[int]:
    """The versions of the one unused reply equal to ``node``'s sampled span; consumes it."""
    ids = [int(t) for t, m in zip(node.token_ids, node.mask, strict=True) if m]
    lps = [_float(x) for x in (node.logprobs or [])]
    near = None
    for k in unused:
        reply = replies[k]
        if list(reply.token_ids) != ids:
            continue
        if _same_floats(reply.logprobs, lps):
            unused.remove(k)
            return [int(v) for v in reply.versions]
        near = k
    if near is not None:
        raise TraceMismatch(
            f"session {session}: a sampled span of {len(ids)} tokens has the ids of engine reply "
            f"{near} but other log-probs ({len(lps)} on the trace vs "
            f"{len(replies[near].logprobs)} from the engine)"
        )
    raise TraceMismatch(
        f"session {session}: a sampled span of {len(ids)} tokens (starting {ids[:8]}) equals no "
        f"engine reply of the session ({len(replies)} replies, {len(unused)} not yet matched)"
    )


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


def _same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def _trace_metrics(trace: Any) -> dict[str, float]:
    out = {f"reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None}
    out.update({f"metric/{k}": float(v) for k, v in trace.metrics.items() if v is not None})
    return {k: v for k, v in out.items() if math.isfinite(v)}
