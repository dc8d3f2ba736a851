"""``python -m jaxrl_orch.tools.staleness``: the study's commands, its resumption, the table and
plot it writes from the runs' files, and the ``--simulate`` prediction. No training: commands
go to a fake runner, and the runs' files are written here in the shape a real run writes them
(``summary.json`` keys and the per-step rows of ``metrics.jsonl``)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from jaxrl_orch.tools import staleness, staleness_sim

# B = 2 prompts x 4 samples = 8 rollouts per step; 20 RL steps.
SMALL = [
    "--gin_param=RL.prompts_per_step=2",
    "--gin_param=RL.group_size=4",
    "--gin_param=RL.steps=20",
]


def _plan(tmp_path, line, *extra):
    """The study's runs for the command line ``line`` (plus ``extra`` arguments)."""
    args = staleness.parse_args([f"--workdir={tmp_path}", *SMALL, *shlex.split(line), *extra])
    return args, {run.label: staleness.command(args, run) for run in staleness.plan(args, 8)}


def _params(cmd):
    return [c.removeprefix("--gin_param=") for c in cmd if c.startswith("--gin_param=")]


def test_one_warm_up_then_the_grid_then_the_policies_without_a_second_admit_run(tmp_path):
    _, cmds = _plan(tmp_path, "--staleness 0 2 --losses grpo icepop --policies admit drop pace")
    assert list(cmds) == [
        "warmup",
        "s0_grpo",
        "s0_icepop",
        "s2_grpo",
        "s2_icepop",
        "s2_grpo_drop",
        "s2_grpo_pace",
    ]
    for cmd in cmds.values():
        assert cmd[1:4] == ["-m", "jaxrl_orch.train", "--gin_file=configs/reverse_text.gin"]
    warm = _params(cmds["warmup"])
    assert warm[:3] == ["RL.prompts_per_step=2", "RL.group_size=4", "RL.steps=20"]
    assert warm[3:5] == ["RL.steps=1", "RL.eval_examples=1"]  # after the user's: they win
    assert not any("from_workdir" in p for p in warm)
    assert f"--workdir={tmp_path / 'warmup'}" in cmds["warmup"]
    for label, cmd in cmds.items():
        if label != "warmup":
            assert f'Warmup.from_workdir="{tmp_path / "warmup"}"' in _params(cmd)
            assert f"--workdir={tmp_path / label}" in cmd
            assert "Orchestrator.max_concurrent=None" in _params(cmd)
    s2 = _params(cmds["s2_grpo"])
    assert s2[3:] == [
        f'Warmup.from_workdir="{tmp_path / "warmup"}"',
        "Orchestrator.max_staleness=2",
        'Orchestrator.age_policy="admit"',
        "Orchestrator.max_concurrent=None",
        "Engine.slots=24",  # (S + 1) x B: every admitted rollout decodes at once
    ]
    assert "Engine.slots=8" in _params(cmds["s0_icepop"])
    assert _params(cmds["s2_icepop"])[-3:] == [
        "RL.recompute_old_logprobs=True",
        "Loss.tis_cap=2.0",
        "Loss.icepop=(0.5, 2.0)",
    ]
    assert _params(cmds["s2_grpo_drop"]) == [
        p.replace('"admit"', '"drop"') for p in s2
    ]  # the same command as the grid's admit run but for the policy
    assert 'Orchestrator.age_policy="pace"' in _params(cmds["s2_grpo_pace"])


def test_each_preset_is_its_bindings_and_every_config_builds(tmp_path):
    flags = "--staleness 1 --slots config --warmup_from /elsewhere/run --losses"
    args, cmds = _plan(tmp_path, flags, *staleness.PRESETS)
    assert "warmup" not in cmds  # its sft/ comes from --warmup_from
    study = 3 + 1  # from_workdir and the three Orchestrator bindings, no Engine.slots
    expected = {
        "grpo": [],
        "decoupled": ["RL.recompute_old_logprobs=True", "Loss.tis_cap=2.0"],
        "icepop": ["RL.recompute_old_logprobs=True", "Loss.tis_cap=2.0", "Loss.icepop=(0.5, 2.0)"],
        "gspo": [
            'Loss.policy_loss="gspo"',
            "Loss.eps_low=3e-4",
            "Loss.eps_high=4e-4",
            'Loss.norm="sequence"',
        ],
        "cispo": ['Loss.policy_loss="cispo"'],
    }
    assert set(expected) == set(staleness.PRESETS)
    for loss, bindings in expected.items():
        params = _params(cmds[f"s1_{loss}"])
        assert params[3 + study :] == bindings, loss
        assert params[3] == 'Warmup.from_workdir="/elsewhere/run"'
        assert not any(p.startswith("Engine.slots") for p in params)
    staleness.check_configs(args, staleness.plan(args, 8))  # raises naming a bad run


def test_bad_input_is_refused_naming_the_value(tmp_path, capsys):
    with pytest.raises(SystemExit):
        staleness.parse_args([f"--workdir={tmp_path}", "--losses", "ppo2"])
    assert "invalid choice: 'ppo2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        staleness.parse_args([f"--workdir={tmp_path}", "--staleness", "1", "-1"])
    assert "--staleness must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        staleness.parse_args([f"--workdir={tmp_path}", "--policies", "admit", "wait"])
    assert "invalid choice: 'wait'" in capsys.readouterr().err
    rc = staleness.main([f"--workdir={tmp_path}", "--gin_param=RL.group_size=1", "--dry_run"])
    assert rc == 2 and "RL.group_size must be >= 2, got 1" in capsys.readouterr().err
    rc = staleness.main([f"--workdir={tmp_path}", *SMALL, "--warmup_from", str(tmp_path / "none")])
    assert rc == 2 and "has no sft/ directory" in capsys.readouterr().err


class FakeRunner:
    """Records each command and writes its workdir's summary.json, as a finished run would."""

    def __init__(self, fail: str | None = None) -> None:
        self.ran: list[str] = []
        self.fail = fail

    def __call__(self, cmd):
        wd = next(c.removeprefix("--workdir=") for c in cmd if c.startswith("--workdir="))
        label = wd.rsplit("/", 1)[-1]
        self.ran.append(label)
        if label == self.fail:
            return 3
        _write_run(Path(wd), 0.4, 0.6, {"0": 8})
        return 0


def test_a_finished_run_is_not_run_again_and_a_failure_stops_the_study(tmp_path, capsys):
    argv = [f"--workdir={tmp_path}", *SMALL, "--staleness", "0", "1", "--losses", "grpo"]
    argv += ["--policies", "admit", "drop", "--policy_staleness", "1"]
    first = FakeRunner(fail="s1_grpo")
    assert staleness.main(argv, runner=first) == 3
    assert first.ran == ["warmup", "s0_grpo", "s1_grpo"]
    assert "run 's1_grpo' exited 3; rerun the command to continue" in capsys.readouterr().err
    second = FakeRunner()
    assert staleness.main(argv, runner=second) == 0
    assert second.ran == ["s1_grpo", "s1_grpo_drop"]  # the admit run is the grid's s1_grpo
    out = capsys.readouterr().out
    assert "[staleness] warmup: done already" in out
    assert "[staleness] s1_grpo: $ python -m jaxrl_orch.train" in out
    third = FakeRunner()
    assert staleness.main(argv, runner=third) == 0 and third.ran == []
    assert (tmp_path / "staleness.md").is_file() and (tmp_path / "staleness.png").is_file()


def _step_row(step, age_max, **extra):
    """A per-step row as the ledger writes it (its orch/ keys), with trainer shares."""
    row = {
        "step": float(step),
        "train/reward_mean": 0.4,
        "orch/version": float(step - 1),
        "orch/age_max": float(age_max),
        "orch/age_mean": age_max / 2,
        "orch/in_flight_s_p50": 2.0,
        "orch/in_flight_s_p95": 2.0 * math.exp(0.5 * 1.6448536269514722),
        "orch/step_s": 0.5,
        "orch/dropped_total": 0.0,
        "trainer/clip_low": 0.0,
        "trainer/clip_high": 0.01,
        "trainer/tis_capped": 0.0,
        "time/train_s": 0.25 * step,
    }
    return {**row, **extra}


def _write_run(wd, before, after, hist, rows=(), dropped=0, resumed=None):
    wd.mkdir(parents=True, exist_ok=True)
    summary = {
        "sft_steps": 10.0,
        "max_staleness": 2,
        "eval_reward_before_rl": before,
        "eval_reward_final": after,
        "eval_sampled_reward_before_rl": before - 0.1,
        "eval_sampled_reward_final": after - 0.05,
        "eval_temperature": 1.0,
        "rl_steps": 4,
        "rl_steps_this_run": 4,
        "resumed_from_step": resumed,
        "rl_seconds": 8.0,
        "age_histogram": hist,
        "age_policy": "admit",
        "dropped": dropped,
    }
    (wd / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [{"step": 1, "sft/loss": 5.6, "sft/step": 1.0}]
    lines += [{"step": 0, "eval/reverse_text/reward_mean": before}]
    lines += [{"step": 0, "eval/reverse_text@t1/reward_mean": before - 0.1}]
    lines += list(rows)
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_table_histogram_and_plot_from_the_runs(tmp_path):
    rows = [_step_row(1, 0), _step_row(2, 1), _step_row(3, 2), _step_row(4, 2)]
    _write_run(tmp_path / "s0_grpo", 0.40, 0.70, {"0": 32}, [_step_row(s, 0) for s in (1, 2)])
    _write_run(tmp_path / "s2_grpo", 0.40, 0.60, {"0": 8, "1": 8, "2": 16}, rows)
    masked = [_step_row(s, 1, **{"trainer/icepop_masked": 0.02 * s}) for s in (1, 2, 3, 4)]
    _write_run(tmp_path / "s2_icepop", 0.40, 0.65, {"0": 10, "1": 22}, masked, resumed=2)
    drop = [_step_row(s, 2, **{"orch/step_s": 1.0}) for s in (1, 2)]
    _write_run(tmp_path / "s2_grpo_drop", 0.40, 0.55, {"0": 3, "2": 1}, drop, dropped=5)
    argv = [f"--workdir={tmp_path}", "--staleness", "0", "2", "--losses", "grpo", "icepop"]
    assert staleness.main([*argv, "--policies", "admit", "drop", "--compare_only"]) == 0
    md = (tmp_path / "staleness.md").read_text()
    assert (
        "| 0 | grpo | 0.400 -> 0.700 (+0.300) | 0.300 -> 0.650 (+0.350) | 0 | 0:100% | 2.000 "
        "| clip low 0.0%, clip high 1.0% |" in md
    )
    assert (
        "| 2 | grpo | 0.400 -> 0.600 (+0.200) | 0.300 -> 0.550 (+0.250) | 2 "
        "| 0:25% 1:25% 2:50% | 2.000 | clip low 0.0%, clip high 1.0% |" in md
    )
    assert (
        "| 2 | icepop | 0.400 -> 0.650 (+0.250) | 0.300 -> 0.600 (+0.300) "
        "| 1 (**never reached S = 2**) | 0:31% 1:69% (last attempt) | 2.000 "
        "| clip low 0.0%, clip high 1.0%, TIS capped 0.0%, IcePop masked 5.0% |" in md
    )
    assert md.index("| 0 | grpo") < md.index("| 2 | grpo") < md.index("| 2 | icepop")
    assert "## Age policies at S = 2 (grpo)" in md
    assert "| admit | 0.600 | 0.550 | 0 | 2 | 2.000 |" in md
    assert "| drop | 0.550 | 0.500 | 5 | 2 | 1.000 |" in md
    assert "- `icepop`: decoupled + IcePop" in md and "`Loss.icepop=(0.5, 2.0)`" in md
    assert "- s0_icepop: `python -m jaxrl_orch.train" in md  # not run: no row, its command
    assert "| 0 | icepop" not in md
    assert (tmp_path / "staleness.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_predicts_each_staleness_before_any_run(tmp_path, capsys):
    argv = [f"--workdir={tmp_path}", *SMALL, "--staleness", "0", "1", "--simulate"]
    flags = ["--sim_latency=fixed:1.0", "--sim_train_time=1.0"]
    assert staleness.main([*argv, *flags], runner=pytest.fail) == 0
    out = capsys.readouterr().out
    assert "batch 8 (4 per group), (S + 1) x batch in flight, 20 steps" in out
    assert "latency fixed:1.0 (--sim_latency); train time 1 s per step (--sim_train_time)" in out
    # Synchronous: generate 1 s then train 1 s; S = 1 overlaps them (less the first fill).
    assert "| 0 | 0.500 | 0 | 0 |" in out
    assert "| 1 | 0.952 | 1 | 1 |" in out
    assert not (tmp_path / "staleness.md").exists()
    # A finished run of the study calibrates what the flags leave out.
    _write_run(tmp_path / "s0_grpo", 0.4, 0.6, {"0": 8}, [_step_row(s, 0) for s in (1, 2, 3)])
    assert staleness.main(argv) == 0
    out = capsys.readouterr().out
    where = f"calibrated from {tmp_path / 's0_grpo' / 'metrics.jsonl'}"
    assert f"latency lognormal:0.6931:0.5 ({where}); train time 0.5 s per step ({where})" in out
    assert "| 0 | 0.198 | 0 | 0 |" in out  # each step waits for its batch's slowest rollout
    assert "| 1 | 0.439 | 3 | 2.05 |" in out  # admit bounds admission only: the tail overshoots
    assert staleness.main(argv) == 0 and capsys.readouterr().out == out  # deterministic


def test_calibration_reads_a_fixed_latency_when_the_tail_is_flat():
    rows = [_step_row(1, 0, **{"orch/in_flight_s_p95": 2.0}), _step_row(2, 0)]
    rows[1]["orch/in_flight_s_p95"] = 2.0
    assert staleness_sim.calibrate(rows) == ("fixed:2", 0.375)
    assert staleness_sim.calibrate([{"step": 1.0, "orch/step_s": 1.0}]) == (None, None)
