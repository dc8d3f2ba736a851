"""``python -m jaxrl_orch.tools.lift``: the controls' commands, and the table and plot it writes."""

from __future__ import annotations

import json

from jaxrl_orch.tools import lift


def _write_run(wd, before, after, word_order, full, evals):
    wd.mkdir(parents=True)
    behaviour = {
        "greedy": {
            "0": {"full": full[0], "word_order": word_order[0]},
            "60": {"full": full[1], "word_order": word_order[1]},
        }
    }
    summary = {
        "eval_reward_before_rl": before,
        "eval_reward_final": after,
        "eval_sampled_reward_before_rl": before - 0.1,
        "eval_sampled_reward_final": after - 0.05,
        "behaviour": behaviour,
        "wall_seconds": 600.4,
    }
    (wd / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": s, "eval/reverse_text/reward_mean": v} for s, v in evals.items()]
    rows += [{"step": s, "eval/reverse_text@t1/reward_mean": 0.0} for s in evals]  # not plotted
    rows.append({"step": 1, "train/reward_mean": 0.3})
    (wd / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_commands_are_plain_train_commands_from_one_warm_up(tmp_path):
    args = lift.parse_args([f"--workdir={tmp_path}", "--seeds", "3", "4"])
    cmds = lift.run_commands(args)
    assert list(cmds) == ["seed3", "seed4", "permuted", "imitation", "clean_sft"]
    for cmd in cmds.values():
        assert cmd[1:3] == ["-m", "jaxrl_orch.train"]
        assert "--gin_file=configs/reverse_text.gin" in cmd
    assert "--gin_param=TrainConfig.seed=4" in cmds["seed4"]
    warm = f'--gin_param=Warmup.from_workdir="{tmp_path / "seed3"}"'
    for control in ("permuted", "imitation", "clean_sft"):
        assert warm in cmds[control]
    assert '--gin_param=RL.algorithm="permuted:grpo"' in cmds["permuted"]
    assert '--gin_param=RL.after_warmup="sft"' in cmds["imitation"]
    assert "--gin_param=Warmup.demonstrations=()" in cmds["clean_sft"]
    assert not any("demonstrations" in c for c in cmds["imitation"])  # the same mixed demos


def test_table_and_plot_from_the_runs(tmp_path):
    _write_run(tmp_path / "seed0", 0.40, 0.85, (0.7, 0.05), (0.2, 0.9), {0: 0.4, 30: 0.7, 60: 0.85})
    _write_run(tmp_path / "permuted", 0.40, 0.41, (0.7, 0.72), (0.2, 0.2), {0: 0.4, 60: 0.41})
    assert lift.main([f"--workdir={tmp_path}", "--seeds", "0", "--compare_only"]) == 0
    md = (tmp_path / "comparison.md").read_text()
    assert (
        "| seed0 | 0.400 -> 0.850 (+0.450) | 0.300 -> 0.800 (+0.500) | 70% -> 5% | 20% -> 90%" in md
    )
    assert "| permuted | 0.400 -> 0.410 (+0.010)" in md
    assert "imitation |" not in md  # not run: no row, but its command is listed
    assert "- imitation: `python -m jaxrl_orch.train" in md
    assert (tmp_path / "comparison.png").stat().st_size > 0
    assert lift.eval_curve(tmp_path / "seed0") == {0: 0.4, 30: 0.7, 60: 0.85}
