"""Every shipped gin config parses into a valid TrainConfig (the files users copy must work)."""

import pytest
from support.checkout import ROOT

from jaxrl_orch.train import load_config

CONFIGS = sorted((ROOT / "configs").glob("*.gin"))
# A recipe around your own checkpoint names it on the command line (configs/model/checkpoint.gin).
NAMED = {"pretrained.gin": ["CHECKPOINT = '/data/Qwen2.5-0.5B-Instruct'"]}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # includes are relative to the repository root
    cfg = load_config([str(path)], NAMED.get(path.name, []))
    assert cfg.rl.steps >= 1 and cfg.rl.batch_size == cfg.rl.prompts_per_step * cfg.rl.group_size
    assert path.read_text().startswith("#")  # each opens with what it runs and how


def test_sync_and_tpu_configs_differ_from_the_default_only_where_documented(monkeypatch):
    monkeypatch.chdir(ROOT)
    base = load_config(["configs/reverse_text.gin"], [])
    sync = load_config(["configs/reverse_text_sync.gin"], [])
    tpu = load_config(["configs/tpu_v5e_8.gin"], [])
    assert sync.orchestrator.max_staleness == 0 and sync.model == base.model
    assert tpu.model != base.model and tpu.trainer.mesh
    assert tpu.orchestrator.max_staleness == base.orchestrator.max_staleness


def test_unknown_binding_is_named():
    with pytest.raises(ValueError, match="no_such_setting"):
        load_config([], ["TrainConfig.no_such_setting = 1"])
    with pytest.raises(ValueError, match="no_such_setting"):
        load_config([], ["RL.no_such_setting = 1"])
    # A name from before the sections says where it went.
    with pytest.raises(ValueError, match=r"TrainConfig.rl_steps is now RL.steps"):
        load_config([], ["TrainConfig.rl_steps = 40"])
    with pytest.raises(ValueError, match=r"TrainConfig.decode_slots is now Engine.slots"):
        load_config([], ["TrainConfig.decode_slots = 4"])
    with pytest.raises(ValueError, match="missing.gin"):
        load_config(["missing.gin"], [])


@pytest.mark.parametrize(
    "binding, message",
    [
        ("RL.max_new_tokens = 256", r"max_new_tokens \(256\) must be < Trainer.row_len \(256\)"),
        ("RL.minibatches = 0", r"minibatches must be >= 1, got 0"),
        ("RL.ppo_epochs = -1", r"ppo_epochs must be >= 1, got -1"),
        ("RL.lr_warmup_steps = -3", r"RL.lr_warmup_steps must be >= 0, got -3"),
        ("Orchestrator.age_policy = 'yolo'", r"age_policy must be one of .*'yolo'"),
        ("Engine.overlap = 'always'", r"Engine.overlap must be one of .*'always'"),
        ("Processes.weight_pull_timeout_s = 0", r"weight_pull_timeout_s must be > 0"),
        ("Orchestrator.env_timeout_s = 0", r"Orchestrator.env_timeout_s must be > 0 or None"),
        ("Engine.slots = 2.5", r"Engine.slots must be an int, got 2.5"),
        ("RL.algorithm = 'ppo'", r"unknown advantage algorithm 'ppo'; choose one of"),
        ("Data.rl_prompt_pool = 0", r"rl_prompt_pool must be >= 1 or None"),
        # Each of these used to pass the config and fail later: mid-run, or after the warm-up.
        ("Outputs.checkpoint_every = 0", r"Outputs.checkpoint_every must be >= 1, got 0"),
        ("RL.learning_rate = 0.0", r"RL.learning_rate must be > 0, got 0.0"),
        ("RL.temperature = -0.5", r"RL.temperature must be > 0, got -0.5"),
        ("RL.max_new_tokens = 0", r"RL.max_new_tokens must be >= 1, got 0"),
        ("RL.eval_examples = 0", r"RL.eval_examples must be >= 1, got 0"),
        ("Outputs.max_to_keep = 0", r"Outputs.max_to_keep must be >= 1, got 0"),
        ("Outputs.log_interval_s = 0", r"Outputs.log_interval_s must be > 0, got 0"),
        ("Warmup.learning_rate = -0.001", r"Warmup.learning_rate must be > 0, got -0.001"),
        ("Engine.slots = 0", r"Engine.slots must be >= 1, got 0"),
        ("Engine.steps_per_call = 0", r"Engine.steps_per_call must be >= 1, got 0"),
        ("Engine.max_target_length = 1", r"Engine.max_target_length must be >= 2, got 1"),
        ("Trainer.chunk_rows = 0", r"Trainer.chunk_rows must be >= 1, got 0"),
        ("Lora.rank = -1", r"Lora.rank must be >= 0, got -1: 0 trains every weight"),
        ("Lora.targets = ('q', 'qkv')", r"Lora.targets must be a non-empty tuple of .*'qkv'"),
        (
            "Trainer.rows_per_batch = 1",
            r"rows_per_batch \(1\) must be None or a multiple of Trainer.chunk_rows \* "
            r"RL.minibatches = 8",
        ),
    ],
)
def test_bad_values_are_named_with_what_is_allowed(binding, message):
    with pytest.raises(ValueError, match=message):
        load_config([], [binding])


def test_stage_schedules_sft_anneals_rl_warms_up_then_holds():
    import gin

    from jaxrl_orch.compose.trainers import optim_config
    from jaxrl_orch.config.load import make_config
    from jaxrl_orch.trainer.optim import make_schedule

    gin.clear_config()  # bindings parsed by earlier tests would apply to TrainConfig(...) too
    cfg = make_config({"Warmup.steps": 100, "Warmup.lr_warmup_steps": 10, "RL.lr_warmup_steps": 5})
    sft = make_schedule(optim_config(cfg, "sft", 3e-3))
    assert float(sft(0)) == 0.0 and float(sft(10)) == pytest.approx(3e-3)
    assert float(sft(100)) == pytest.approx(3e-4)  # annealed to 10% at the last warm-up step
    assert float(sft(55)) < 3e-3
    rl = make_schedule(optim_config(cfg, "rl", 3e-4))
    assert float(rl(0)) == 0.0 and float(rl(5)) == pytest.approx(3e-4)
    assert float(rl(10_000)) == pytest.approx(3e-4)  # open-ended: no decay
    # A warm-up no longer than its ramp keeps the ramp and no decay.
    short = make_schedule(optim_config(make_config({"Warmup.steps": 2}), "sft", 1e-3))
    assert float(short(1)) == pytest.approx(1e-4)


def test_model_config_limits_logits_to_the_tokenizers_ids():
    from types import SimpleNamespace

    from jaxrl_orch.compose.model import model_config
    from jaxrl_orch.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    cfg = model_config("tiny-byte", tok)
    assert cfg.output_vocab == tok.output_vocab_size < cfg.vocab_size == tok.vocab_size
    assert model_config("tiny-byte", SimpleNamespace(output_vocab_size=512)).output_vocab is None
    with pytest.raises(ValueError, match="tokenizer produces 600 ids but model 'tiny-byte'"):
        model_config("tiny-byte", SimpleNamespace(output_vocab_size=600))


def test_a_text_file_dataset_is_split_or_paired_with_an_eval_file(tmp_path):
    import gin
    from support.runs import prepare

    from jaxrl_orch.config.load import make_config
    from jaxrl_orch.data.sources import text_split_of

    gin.clear_config()
    lines = [f"the harbour painted {i} walls" for i in range(120)]
    corpus = tmp_path / "mine.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = prepare(make_config({"Data.dataset": f"text:{corpus}"}), tmp_path / "a").data
    held_out = [data.eval.next_example()["text"] for _ in range(len(data.eval))]
    assert held_out and all(text_split_of(t) == "eval" for t in held_out)
    assert len(data.train) + len(data.eval) == 120

    other = tmp_path / "eval.txt"
    other.write_text("one held out sentence\nand a second one\n", encoding="utf-8")
    paired = {"Data.dataset": str(corpus), "Data.eval_dataset": str(other)}
    data = prepare(make_config(paired), tmp_path / "b").data
    assert len(data.eval) == len(data.sampled_eval) == 2  # the whole eval file
    assert len(data.train) == len(data.sft) == 120  # all of it trains now

    leaky = tmp_path / "leaky.txt"
    leaky.write_text("a fresh sentence\nthe harbour painted 7 walls\n", encoding="utf-8")
    cfg = make_config({"Data.dataset": str(corpus), "Data.eval_dataset": str(leaky)})
    with pytest.raises(ValueError, match="1 of 2 lines of eval_dataset .*'the harbour painted 7"):
        prepare(cfg, tmp_path / "c")


def test_a_gin_import_registers_a_user_env_for_the_command(tmp_path, monkeypatch):
    from support.runs import prepare

    (tmp_path / "shout_env.py").write_text(
        "from jaxrl_orch.envs.base import SingleTurnEnv, register_env\n"
        "class Shout(SingleTurnEnv):\n"
        "    name = 'shout'\n"
        "    def build_messages(self, ex):\n"
        "        return [{'role': 'user', 'content': 'Shout: ' + ex['text']}]\n"
        "    def score(self, text, ex):\n"
        "        return float(text.strip() == ex['text'].upper()), {}\n"
        "    def reference_completion(self, ex):\n"
        "        return ex['text'].upper()\n"
        "register_env('shout', lambda tokenizer, **kw: Shout(tokenizer, **kw))\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    gin_file = tmp_path / "shout.gin"
    gin_file.write_text(
        "import shout_env\ninclude 'configs/reverse_text.gin'\nData.env = 'shout'\n",
        encoding="utf-8",
    )
    # The default's mixed demonstrator names reverse-text behaviours this env does not offer.
    with pytest.raises(ValueError, match="env 'shout' offers no worse behaviours.*demonstrations"):
        prepare(load_config([str(gin_file)], []), tmp_path / "run")
    cfg = load_config([str(gin_file)], ["Warmup.demonstrations = ()"])
    parts = prepare(cfg, tmp_path / "run")
    assert type(parts.env).__name__ == "Shout" and parts.env.instruction == "Reverse:"
    prompt = parts.tokenizer.decode(parts.env.prompt_ids({"text": "abc"}))
    assert "Shout: abc" in prompt


def test_probe_settings_restrict_the_prompts_and_reuse_another_runs_warm_up(tmp_path):
    import gin
    import jax
    import numpy as np
    from flax import nnx
    from support.runs import prepare, warmup

    from jaxrl_orch.config.load import make_config

    gin.clear_config()
    small = {
        "Warmup.steps": 2,
        "Warmup.batch_size": 4,
        "Trainer.mesh": (("fsdp", 1),),
        "Engine.mesh": (("tp", 1),),
    }
    first = prepare(make_config({**small, "seed": 3}), tmp_path / "first")
    warm, info = warmup(first, tmp_path / "m1.jsonl")
    assert "sft_restored" not in info

    probe_settings = {
        **small,
        "Warmup.steps": 5,
        "Warmup.from_workdir": str(tmp_path / "first"),
        "Data.rl_prompt_pool": 3,
    }
    probe = prepare(make_config(probe_settings), tmp_path / "probe")
    assert len(probe.data.train) == 3
    drawn = {probe.data.train.next_example()["text"] for _ in range(12)}
    assert len(drawn) == 3  # four epochs over the same three prompts
    params, info = warmup(probe, tmp_path / "m2.jsonl")
    assert info["sft_restored"] == 1.0  # the copied warm-up, not two fresh SFT steps
    assert info["sft_steps"] == 2.0
    a, b = nnx.to_pure_dict(warm), nnx.to_pure_dict(params)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert (tmp_path / "probe" / "sft").is_dir()  # copied: the probe's workdir stands alone

    with pytest.raises(ValueError, match="has no sft/ checkpoint directory"):
        prepare(make_config({**small, "Warmup.from_workdir": str(tmp_path)}), tmp_path / "x")
    with pytest.raises(ValueError, match="rl_prompt_pool 10000000 exceeds the"):
        prepare(make_config({**small, "Data.rl_prompt_pool": 10_000_000}), tmp_path / "y")


def test_loss_settings_reach_the_rl_step(tmp_path):
    """dr_grpo trains with Dr. GRPO's constant normalisation (the generation budget), TIS with
    recomputed old log-probs is a TrainConfig setting, and a contradicting norm is refused."""
    import gin
    from support.runs import prepare

    from jaxrl_orch.compose.engines import recompute_old_logprobs
    from jaxrl_orch.compose.trainers import step_config
    from jaxrl_orch.config.load import make_config

    gin.clear_config()
    small = {"Warmup.steps": 0, "Trainer.mesh": (("fsdp", 1),), "Engine.mesh": (("tp", 1),)}
    cases = {
        "grpo": {"RL.algorithm": "grpo"},
        "dr": {"RL.algorithm": "dr_grpo", "Loss.norm": "constant", "RL.max_new_tokens": 40},
        "tis": {"RL.algorithm": "grpo", "RL.recompute_old_logprobs": True, "Loss.tis_cap": 1.5},
    }
    steps = {}
    for name, kw in cases.items():
        parts = prepare(make_config({**small, **kw}), tmp_path / name)
        # The built-in engine reports behaviour log-probs: the run's recompute decision for it.
        recompute = recompute_old_logprobs(parts.cfg, engine_logprobs=True)
        steps[name] = step_config(parts.cfg, "rl", recompute=recompute)
    assert steps["grpo"].loss.norm == "token" and steps["grpo"].loss.norm_constant is None
    assert steps["dr"].loss.norm == "constant" and steps["dr"].loss.norm_constant == 40.0
    assert not steps["grpo"].recompute_old_logprobs
    assert steps["tis"].recompute_old_logprobs and steps["tis"].loss.tis_cap == 1.5
    with pytest.raises(ValueError, match="'dr_grpo' normalises the loss by a constant"):
        load_config([], ["RL.algorithm = 'dr_grpo'", "Loss.norm = 'token'"])
    # the step reads the RL section's loss object as it is: no copy field by field
    parts = prepare(make_config({**small, **cases["tis"]}), tmp_path / "same")
    assert step_config(parts.cfg, "rl").loss is parts.cfg.rl.loss
    with pytest.raises(ValueError, match=r"RL.after_warmup must be one of \('rl', 'sft'\).*'dpo'"):
        load_config([], ["RL.after_warmup = 'dpo'"])


def test_a_refused_config_leaves_no_bindings_behind():
    from jaxrl_orch.config.train import TrainConfig

    with pytest.raises(ValueError, match="after_warmup"):
        load_config([], ["RL.steps = 7", "RL.after_warmup = 'dpo'"])
    assert TrainConfig().rl.steps == 60 and TrainConfig().rl.after_warmup == "rl"


def test_a_group_of_one_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"group_size must be >= 2, got 1: group-relative"):
        load_config([], ["RL.group_size = 1"])


def test_one_over_long_line_anywhere_fails_before_any_work_naming_it(tmp_path):
    """Every example is checked, warm-up samples against row_len and RL / eval prompts against
    the engine's prefill limit; the error names the file, the line and the limit."""
    import gin
    from support.runs import prepare

    from jaxrl_orch.config.load import make_config

    gin.clear_config()
    lines = [f"sentence number {i} is short" for i in range(300)]
    lines.insert(137, "x" * 10_000)
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "eval.txt").write_text("a held-out line\n\n" + "y" * 400 + "\n")
    (tmp_path / "ok_eval.txt").write_text("an eval line\nanother eval line\n")
    base = {
        "Trainer.mesh": (("fsdp", 1),),
        "Engine.mesh": (("tp", 1),),
        "Warmup.demonstrations": (),
    }

    def fails(match, dataset, eval_dataset, **kw):
        data = {"Data.dataset": dataset, "Data.eval_dataset": eval_dataset}
        cfg = make_config({**base, **data, **kw})
        with pytest.raises(ValueError, match=match):
            prepare(cfg, tmp_path / "run")

    corpus, ok_eval = f"text:{tmp_path / 'corpus.txt'}", f"text:{tmp_path / 'ok_eval.txt'}"
    fails(
        r"a warm-up sample \(prompt \+ demonstration \+ EOS\) has 20051 tokens, over the limit "
        r"of 256: \S*corpus.txt line 138 \(\{'text': 'xxx.*raise Trainer.row_len",
        dataset=corpus,
        eval_dataset=ok_eval,
    )
    fails(  # no warm-up: the RL prompt itself is over the engine's prefill limit
        r"an RL prompt has 10033 tokens, over the limit of 128: \S*corpus.txt line 138 .*"
        r"prefill limit 128 \(max_target_length // 2\) and row_len 256 - max_new_tokens 68",
        dataset=corpus,
        eval_dataset=ok_eval,
        **{"Warmup.steps": 0},
    )
    fails(  # the held-out set is read whole too
        r"an eval prompt has 433 tokens, over the limit of 128: \S*eval.txt line 3 ",
        dataset=ok_eval,
        eval_dataset=f"text:{tmp_path / 'eval.txt'}",
        **{"Warmup.steps": 0},
    )


def test_a_verifiers_run_names_its_environment_and_leaves_the_prompts_to_it():
    with pytest.raises(ValueError, match=r"Data.env = 'verifiers' needs the environment"):
        load_config([], ["Data.env = 'verifiers'"])
    spec = "Verifiers.env = {'taskset': {'id': 'jaxrl-reverse-text'}}"
    with pytest.raises(ValueError, match=r"Data.instruction \('R:'\) does not apply"):
        load_config([], ["Data.env = 'verifiers'", spec, "Data.instruction = 'R:'"])
    cfg = load_config(["configs/verifiers.gin"], [])
    assert cfg.verifiers.env == {"taskset": {"id": "jaxrl-reverse-text"}}
    override = "VERIFIERS_ENV = {'taskset': {'id': 'jaxrl-two-turn'}}"
    assert load_config(["configs/verifiers.gin"], [override]).verifiers.env["taskset"] == {
        "id": "jaxrl-two-turn"
    }


def test_a_bare_name_is_refused_unless_a_file_reads_it_as_a_macro(tmp_path):
    """``--gin_param=seed=1`` is a gin macro nothing reads: gin would accept it and record it in
    config.gin while the run trains with seed 0. Refused, naming the setting meant; a macro a
    file reads (``%VERIFIERS_ENV``) still binds."""
    import gin

    with pytest.raises(ValueError, match=r"'seed=1' names no section.*'TrainConfig.seed = \.\.\.'"):
        load_config([], ["seed=1"])
    both = r"'Warmup.steps = \.\.\.' or 'RL.steps = \.\.\.'"
    with pytest.raises(ValueError, match=rf"'steps = 3' names no section.*{both}"):
        load_config([], ["steps = 3"])
    with pytest.raises(
        ValueError,
        match=r"'NOTHING = 2' names no section: .*reads %NOTHING \(a setting is Section.name",
    ):
        load_config([], ["NOTHING = 2"])
    uses = tmp_path / "uses.gin"
    uses.write_text("STEPS = 5\nRL.steps = %STEPS\n")
    try:
        assert load_config([str(uses)], ["STEPS = 7"]).rl.steps == 7
        assert load_config([], ["TrainConfig.seed = 3"]).seed == 3
    finally:
        gin.clear_config()
