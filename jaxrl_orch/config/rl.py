"""The ``RL`` section of TrainConfig (``config.train``): the RL stage's algorithm, optimizer,
sampling and evals, and its loss (``RL.loss``, the ``Loss`` section: ``PolicyLossConfig``, whose
fields the train step reads as they are). Read by ``run.rl`` and ``compose.trainers``.

What it owns besides the fields: the checks that tie the loss to the algorithm (Dr. GRPO
normalises by a constant) and the one derived loss value, norm 'constant''s divisor, filled in
from ``max_new_tokens`` when unset. Pure: no JAX.
"""

from __future__ import annotations

import dataclasses

from jaxrl_orch.algorithms.advantages import get_algorithm
from jaxrl_orch.algorithms.loss_config import PolicyLossConfig
from jaxrl_orch.config.section import bind, section
from jaxrl_orch.settings import Allowed, check_settings, require, setting

Loss = bind(PolicyLossConfig)


@section("RL")
class RLSettings:
    after_warmup: str = setting(
        "rl",
        "'rl', or the imitation control 'sft': the RL stage's optimizer updates spent on more "
        "SFT of the demonstrations instead, evaluated alike (run/control.py)",
        Allowed.one_of("rl", "sft"),
    )
    steps: int = setting(60, "RL steps (optimizer updates of the RL stage)", Allowed.at_least(1))
    prompts_per_step: int = setting(8, "prompts per training batch", Allowed.at_least(1))
    group_size: int = setting(
        16,
        "rollouts per prompt",
        Allowed.at_least(2).because(
            "group-relative advantages compare the rollouts of one prompt, so a group of one "
            "has none"
        ),
    )
    algorithm: str = setting(
        "grpo",
        "the advantage estimator: 'grpo' (mean-centred), 'grpo_std', 'dr_grpo', 'rloo'; "
        "'permuted:NAME' is its noise-only control",
    )
    dynamic_sampling: bool = setting(
        True, "drop groups whose rewards are all equal and wait for groups with signal (DAPO)"
    )
    learning_rate: float = setting(1e-4, "the RL stage's learning rate", Allowed.above(0))
    lr_warmup_steps: int = setting(
        10,
        "linear learning-rate warmup (fresh Adam moments on noisy policy gradients)",
        Allowed.at_least(0),
    )
    temperature: float = setting(
        1.0,
        "sampling temperature of train rollouts (and of the sampled eval)",
        Allowed.above(0).because("at 0 every sample of a group is alike"),
    )
    max_new_tokens: int = setting(68, "tokens a rollout may generate", Allowed.at_least(1))
    recompute_old_logprobs: bool | None = setting(
        None,
        "recompute the trainer's old log-probs before the update (the TIS weight's numerator); "
        "None: only when the engine reports no behaviour log-probs (upstream JetStream's do not)",
    )
    minibatches: int = setting(
        1,
        "optimizer steps per RL batch (the batch split into this many parts)",
        Allowed.at_least(1),
    )
    ppo_epochs: int = setting(1, "passes over the batch per RL step", Allowed.at_least(1))
    eval_every: int = setting(
        10,
        "RL steps between two evals of the held-out set (0: first and last)",
        Allowed.at_least(0),
    )
    eval_examples: int = setting(
        128, "held-out examples each eval decodes (greedy, and sampled)", Allowed.at_least(1)
    )
    loss: PolicyLossConfig = dataclasses.field(default_factory=Loss)

    def __post_init__(self) -> None:
        algorithm = get_algorithm(self.algorithm)  # an unknown name fails, naming the known
        check_settings(self)
        token_sum = getattr(algorithm, "token_sum_normalization", False)
        require(
            not token_sum or self.loss.norm == "constant",
            f"algorithm {self.algorithm!r} normalises the loss by a constant (Dr. GRPO); "
            f"set Loss.norm = 'constant' (got {self.loss.norm!r})",
        )
        object.__setattr__(self, "loss", self.loss.for_budget(self.max_new_tokens))

    @property
    def batch_size(self) -> int:
        """Rollouts per training batch."""
        return self.prompts_per_step * self.group_size


# lm-eval's API models the live server answers, and the route each one posts to
HARNESS_ROUTES = {
    "local-completions": "/v1/completions",
    "local-chat-completions": "/v1/chat/completions",
}


@section("HarnessEval")
class HarnessEvalSettings:
    """lm-evaluation-harness tasks scored against the live policy while the run trains
    (``run.harness_eval``); needs ``Engine.serve_port`` and lm-eval (the ``evals`` extra)."""

    tasks: tuple[str, ...] = setting(
        (),
        "lm-eval task names scored every `every` RL steps against the live policy "
        "(Engine.serve_port); (): off",
    )
    every: int = setting(
        10,
        "RL steps between two harness runs (a due one is skipped, and counted, while the "
        "last still runs)",
        Allowed.at_least(1),
    )
    model: str = setting(
        "local-completions",
        "lm-eval's API model: 'local-completions' (log-likelihood and generation tasks) or "
        "'local-chat-completions' (generation, the chat template applied)",
        Allowed.one_of(*HARNESS_ROUTES),
    )
    limit: int | None = setting(
        None,
        "examples per task (lm-eval's --limit); None: every one",
        Allowed.at_least(1).or_none(),
    )
    include_path: str | None = setting(
        None, "a directory of the user's own task YAMLs (lm-eval's --include_path)"
    )
    concurrent: int = setting(
        8, "requests lm-eval keeps in flight (its num_concurrent)", Allowed.at_least(1)
    )
    timeout_s: float = setting(
        1800.0,
        "a harness run still going after this long is stopped and counted as failed",
        Allowed.above(0),
    )

    def __post_init__(self) -> None:
        check_settings(self)
        names = [t for t in self.tasks if not isinstance(t, str) or not t.strip()]
        require(not names, f"HarnessEval.tasks holds task names (str), got {self.tasks!r}")
