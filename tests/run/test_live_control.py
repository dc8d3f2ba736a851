"""Nothing outside the run can stop, skew or poison it through the policy it serves while training.

Short toy runs (``support.toy_rl``) with ``Engine.serve_port``, whose environment (``ProbeEnv``)
acts as an outside caller of the live server at a known point of the run, over HTTP:

- by default, ``POST /pause``, ``POST /update_weights`` and ``POST /resume`` are refused (403,
  naming the route and ``Engine.serve_control``) and the run trains every step once, nothing cut;
- with ``Engine.serve_control`` handing them out, a ``pause?mode=abort`` in the middle of a step
  cuts what is in flight: each cut rollout is kept out of training (none is in ``rollouts/``),
  counted under ``abort`` in the step rows and the summary, and the pause and the resume are on
  the console and in the gauges;
- and a pause nobody resumes ends the run in a ``PipelineStallError`` that names it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.runs import prepare, run
from support.toy_rl import LowercaseEnv, _TextOnly, toy_config
from support.train_cmd import all_rows

from jaxrl_orch.envs.base import register_env
from jaxrl_orch.orchestrator.progress import PipelineStallError

STEPS = 4
UPDATE = {"version": 9, "uuid": 1, "timeout_s": 5}


class Probe:
    """What ``ProbeEnv`` does as an outside caller (``act``), and what it saw."""

    def __init__(self, port: int, act: Callable[..., Awaitable[Any]]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.act = act
        self.done = False
        self.busy = False  # one probe at a time: rollouts run concurrently
        self.replies: list[httpx.Response] = []
        self.rollouts: list[Any] = []  # every rollout the env returned (stamped by the loop)
        self.own_cut: list[Any] = []  # the probe's own rollouts its pause cut

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        reply = await asyncio.to_thread(httpx.post, f"{self.url}{path}", timeout=60, **kwargs)
        self.replies.append(reply)
        return reply


class ProbeEnv(LowercaseEnv):
    name = "control_probe"
    probe: Probe | None = None

    async def run(self, client, example, **kw):
        probe = ProbeEnv.probe

        def rollout():
            return super(ProbeEnv, self).run(client, example, **kw)

        r = None
        if not (probe.done or probe.busy):
            probe.busy = True
            try:
                r = await probe.act(probe, rollout)
            finally:
                probe.busy = False
        r = await rollout() if r is None else r
        probe.rollouts.append(r)
        return r


register_env(ProbeEnv.name, lambda tokenizer, **kw: ProbeEnv(_TextOnly(tokenizer), **kw))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(wd: Path, act: Callable[..., Awaitable[Any]], **settings: Any) -> tuple[dict, Probe]:
    port = _free_port()
    ProbeEnv.probe = Probe(port, act)
    cfg = toy_config(
        {
            "Data.env": ProbeEnv.name,
            "RL.steps": STEPS,
            "Engine.serve_port": port,
            "Engine.warmup": False,
            "Outputs.export_hf": False,
            **settings,
        }
    )
    return run(prepare(cfg, wd)), ProbeEnv.probe


def _step_rows(wd: Path) -> list[dict]:
    return [r for r in all_rows(wd) if "train/reward_mean" in r]


def _trained(wd: Path) -> set[tuple[int, int]]:
    rows = (json.loads(x) for p in (wd / "rollouts").glob("step_*.jsonl") for x in p.open())
    return {(r["group_id"], r["episode_id"]) for r in rows}


def _last_gauges(wd: Path) -> dict:
    return json.loads((wd / "gauges.jsonl").read_text().splitlines()[-1])


async def _outside_calls(probe: Probe, rollout: Callable[[], Awaitable[Any]]) -> None:
    probe.done = True
    await probe.post("/pause", params={"mode": "keep"})
    await probe.post("/update_weights", json=UPDATE)
    await probe.post("/resume")


def test_outside_control_calls_are_refused_and_the_run_trains_every_step(tmp_path):
    summary, probe = _run(tmp_path, _outside_calls)

    paths = ["/pause", "/update_weights", "/resume"]
    assert [r.status_code for r in probe.replies] == [403, 403, 403]
    for reply, path in zip(probe.replies, paths, strict=True):
        message = reply.json()["error"]["message"]
        assert f"POST {path} is refused" in message and "Engine.serve_control" in message
    assert summary["rl_steps"] == STEPS
    rows = _step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step, once
    assert all(r["trainer/version"] == r["step"] for r in rows)  # no outside version
    assert not any(r.cut for r in probe.rollouts)
    assert summary["rollouts"]["untrainable"] == {"abort": 0, "cancelled": 0}
    gauges = _last_gauges(tmp_path)
    assert gauges["serve/caller_pauses_total"] == 0 and gauges["serve/paused_by_caller"] == 0


async def _abort_mid_step(probe: Probe, rollout: Callable[[], Awaitable[Any]]) -> Any:
    """Once the trainer has published version 1 (a train rollout: the next eval is the last
    step's), start this rollout, then pause with abort and resume; again on a later rollout
    until one of the probe's own was cut."""
    health = await asyncio.to_thread(httpx.get, f"{probe.url}/health", timeout=60)
    if health.json()["version"] < 1:
        return None
    own = asyncio.ensure_future(rollout())
    await asyncio.sleep(0)  # its request is queued before the pause is sent
    await probe.post("/pause", params={"mode": "abort"})
    await probe.post("/resume")
    r = await own
    if r.cut is not None:
        probe.own_cut.append(r)
        probe.done = True
    return r


def test_a_pause_that_cuts_rollouts_trains_none_of_them_and_counts_them(tmp_path, capsys):
    # 4 slots for 32 rollouts a step: the abort ends queued requests as well as running ones.
    control = {"Engine.serve_control": True, "Engine.slots": 4}
    summary, probe = _run(tmp_path, _abort_mid_step, **control)

    assert probe.own_cut and all(r.status_code == 200 for r in probe.replies)
    train = [r for r in probe.rollouts if not r.is_eval]
    cut = {(r.group_id, r.episode_id) for r in train if r.cut is not None}
    assert {r.cut for r in train if r.cut is not None} == {"abort"}
    assert all(not r.trainable for r in train if r.cut is not None)
    assert (probe.own_cut[-1].group_id, probe.own_cut[-1].episode_id) in cut
    trained = _trained(tmp_path)
    assert trained and not trained & cut  # no cut rollout was trained
    rows = _step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    in_rows = sum(r["train/untrainable/abort"] for r in rows)
    assert 1 <= in_rows <= len(cut)  # a window after the last batch is in no row
    assert summary["rollouts"]["untrainable"]["abort"] == len(cut)
    out = capsys.readouterr().out
    pauses = sum(r.request.url.path == "/pause" for r in probe.replies)
    assert (
        out.count("!! the engine is paused (mode abort) by POST /pause from 127.0.0.1:") == pauses
    )
    assert out.count("the engine resumed (POST /resume from 127.0.0.1:") == pauses
    gauges = _last_gauges(tmp_path)
    assert gauges["serve/caller_pauses_total"] == pauses and gauges["serve/paused_by_caller"] == 0


async def _pause_for_good(probe: Probe, rollout: Callable[[], Awaitable[Any]]) -> None:
    probe.done = True
    await probe.post("/pause", params={"mode": "keep"})


def test_a_pause_nobody_resumes_ends_the_run_in_a_stall_error_naming_it(tmp_path, capsys):
    stalled = r"no progress for \d+s \(stall_timeout_s=3\).*; the engine is paused \(by POST "
    with pytest.raises(PipelineStallError, match=stalled + r"/pause from 127\.0\.0\.1:\d+\)"):
        _run(
            tmp_path,
            _pause_for_good,
            **{"Engine.serve_control": True, "Orchestrator.stall_timeout_s": 3.0},
        )
    assert "!! the engine is paused (mode keep) by POST /pause from" in capsys.readouterr().out
