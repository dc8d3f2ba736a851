"""The ``RL`` section of TrainConfig (``config.train``): the RL stage's algorithm, its loss and
off-policy corrections, optimizer, sampling and evals, read by ``run.rl`` and ``compose.precision``.
Its own module because it is the section that grows with the algorithms: each correction is a
setting here, checked with the same code as the loss's own config
(``algorithms.correction_settings``). Pure: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import gin

from jaxrl_orch.algorithms.correction_settings import MIS_LEVELS, POLICY_LOSSES
from jaxrl_orch.config.checks import Allowed, check_allowed, require


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RL:
    """The RL stage. The off-policy corrections (docs/losses.md; combinable):

    - ``policy_loss``: "ppo" (clipped token surrogate), "gspo" / "gspo_token" (sequence ratio
      clipped to [1 - eps_low, 1 + eps_high]; the paper's eps are 3e-4 / 4e-4) or "cispo".
    - ``eps_low_is`` / ``eps_high_is``: CISPO's weight band [1 - eps_low_is, 1 + eps_high_is].
    - ``icepop``: (a, b) or None: drop tokens whose trainer/engine ratio leaves [a, b].
    - ``mis``: None, "token" or "sequence": rejection sampling on that ratio (or its product).
    - ``mis_bounds``: (low, high), the band of ``mis`` (set exactly when ``mis`` is).
    - ``geo_mask``: (low, high) or None: drop sequences whose geometric-mean ratio leaves it.
    """

    # "rl", or the imitation control "sft": the RL stage's optimizer updates spent on more SFT
    # of the demonstrations instead, evaluated alike (run/control.py)
    after_warmup: str = "rl"
    steps: int = 60
    prompts_per_step: int = 8
    group_size: int = 16
    algorithm: str = "grpo"  # mean-centred GRPO; "permuted:grpo" = its noise-only control
    dynamic_sampling: bool = True  # drop flat groups and wait for groups with signal (DAPO)
    learning_rate: float = 1e-4
    lr_warmup_steps: int = 10  # linear LR warmup (fresh Adam moments on noisy policy gradients)
    temperature: float = 1.0
    max_new_tokens: int = 68
    eps_low: float = 0.2
    eps_high: float = 0.28
    # None: the algorithm's own ("constant" over max_new_tokens for dr_grpo, else "token")
    loss_norm: str | None = None
    # Truncated importance sampling: recompute the trainer's old log-probs before the update
    # and weight each token by min(pi_old / pi_behaviour, tis_cap) (None: no TIS weight).
    # None: only when the engine reports no behaviour log-probs (upstream JetStream's do not).
    recompute_old_logprobs: bool | None = None
    tis_cap: float | None = 2.0
    minibatches: int = 1  # optimizer steps per RL batch (the batch split into this many parts)
    ppo_epochs: int = 1  # passes over the batch per RL step
    kl_beta: float = 0.0
    # The policy term: "ppo" (the clipped token surrogate), "gspo", "gspo_token" or "cispo"
    policy_loss: str = "ppo"
    eps_low_is: float = 1.0  # CISPO weight clipped below at 1 - eps_low_is (1: no lower bound)
    eps_high_is: float = 0.28  # CISPO weight clipped above at 1 + eps_high_is
    # Masks on rho = pi_trainer / pi_behaviour (trainer: the recomputed old log-probs when
    # recompute_old_logprobs, else the current policy); a dropped token's policy term is 0.
    icepop: tuple[float, float] | None = None  # IcePop: drop tokens with rho outside (a, b)
    mis: str | None = None  # rejection sampling (MIS): "token" (rho) or "sequence" (prod rho)
    mis_bounds: tuple[float, float] | None = None  # the (low, high) band of mis
    geo_mask: tuple[float, float] | None = None  # drop sequences: exp(mean log rho) outside
    eval_every: int = 10  # RL steps between two evals of the held-out set (0: first and last)
    eval_examples: int = 128  # held-out examples each eval decodes (greedy, and sampled)

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "after_warmup": Allowed.one_of("rl", "sft"),
        "steps": Allowed.at_least(1),
        "prompts_per_step": Allowed.at_least(1),
        "group_size": Allowed.at_least(2).because(
            "group-relative advantages compare the rollouts of one prompt, so a group of one "
            "has none"
        ),
        "learning_rate": Allowed.above(0),
        "lr_warmup_steps": Allowed.at_least(0),
        "temperature": Allowed.above(0).because("at 0 every sample of a group is alike"),
        "max_new_tokens": Allowed.at_least(1),
        "eps_low": Allowed.between(0, 1),
        "eps_high": Allowed.at_least(0),
        "loss_norm": Allowed.one_of(None, "token", "sequence", "constant"),
        "tis_cap": Allowed.above(0).or_none(),
        "minibatches": Allowed.at_least(1),
        "ppo_epochs": Allowed.at_least(1),
        "kl_beta": Allowed.at_least(0),
        "policy_loss": Allowed.one_of(*POLICY_LOSSES),
        "eps_low_is": Allowed.between(0, 1).because("1: no lower bound"),
        "eps_high_is": Allowed.at_least(0),
        "icepop": Allowed.ratio_band().or_none(),
        "mis": Allowed.one_of(None, *MIS_LEVELS),
        "mis_bounds": Allowed.ratio_band().or_none(),
        "geo_mask": Allowed.ratio_band().or_none(),
        "eval_every": Allowed.at_least(0),
        "eval_examples": Allowed.at_least(1),
    }

    def __post_init__(self) -> None:
        from jaxrl_orch.algorithms.advantages import get_algorithm

        algorithm = get_algorithm(self.algorithm)  # an unknown name fails, naming the known
        check_allowed(self)
        token_sum = getattr(algorithm, "token_sum_normalization", False)
        require(
            not token_sum or self.loss_norm in (None, "constant"),
            f"algorithm {self.algorithm!r} normalises the loss by a constant (Dr. GRPO); "
            f"loss_norm {self.loss_norm!r} contradicts it: leave loss_norm unset",
        )
        self._check_corrections()

    def _check_corrections(self) -> None:
        from jaxrl_orch.algorithms.correction_settings import check_settings

        check_settings(self, prefix="RL.")

    @property
    def batch_size(self) -> int:
        """Rollouts per training batch."""
        return self.prompts_per_step * self.group_size

    @property
    def resolved_loss_norm(self) -> str:
        """``loss_norm``, or the algorithm's own when unset (see the field's comment)."""
        from jaxrl_orch.algorithms.advantages import get_algorithm

        if self.loss_norm is not None:
            return self.loss_norm
        token_sum = getattr(get_algorithm(self.algorithm), "token_sum_normalization", False)
        return "constant" if token_sum else "token"
