"""``PolicyLossConfig``: the settings of the policy loss and its off-policy corrections, free of
JAX, declared once on their fields (``jaxrl_orch.settings``).

The run binds it as the ``Loss`` section (``Loss.tis_cap = 2.0``), nested in the ``RL`` section
(``RL.loss``), and the train step reads that object as it is (``StepConfig.loss``); the loss
functions (``losses``, ``corrections``) read it inside ``jax.jit``. A bad value is refused here,
naming ``Loss.<field>``, the value and what is allowed, wherever the config was made.

The corrections (docs/losses.md; combinable):

- ``policy_loss``: "ppo" (clipped token surrogate), "gspo" / "gspo_token" (sequence ratio
  clipped to [1 - eps_low, 1 + eps_high]; the paper's eps are 3e-4 / 4e-4) or "cispo";
- ``eps_low_is`` / ``eps_high_is``: CISPO's weight band [1 - eps_low_is, 1 + eps_high_is];
- ``icepop``: drop tokens whose trainer/engine ratio leaves (a, b);
- ``mis`` with ``mis_bounds``: rejection sampling on that ratio, or on its product;
- ``geo_mask``: drop sequences whose geometric-mean ratio leaves the band.

``BOUNDED`` settings arrive from gin or JSON as lists; they are stored as float pairs so the
config stays hashable (a jit static argument).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

from jaxrl_orch.settings import Allowed, check_settings, require, setting

POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")
MIS_LEVELS = ("token", "sequence")
NORMS = ("token", "sequence", "constant")
BOUNDED = ("icepop", "mis_bounds", "geo_mask")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """See the module docstring."""

    SECTION: ClassVar[str] = "Loss"

    eps_low: float = setting(
        0.2,
        "ratio clip below: [1 - eps_low, 1 + eps_high] (DAPO clip-higher)",
        Allowed.between(0, 1),
    )
    eps_high: float = setting(0.28, "ratio clip above", Allowed.at_least(0))
    norm: str = setting(
        "token",
        "how token losses are averaged: 'token' (over every loss token of the batch), 'sequence' "
        "(per sequence, then over sequences) or 'constant' (summed per sequence over a constant, "
        "Dr. GRPO: set it with RL.algorithm = 'dr_grpo')",
        Allowed.one_of(*NORMS),
    )
    norm_constant: float | None = setting(
        None,
        "the divisor of norm 'constant'; None: RL.max_new_tokens (the generation budget)",
        Allowed.above(0).or_none(),
    )
    tis_cap: float | None = setting(
        2.0,
        "truncated importance sampling: each token's loss weighted by min(pi_old / "
        "pi_behaviour, tis_cap) when old log-probs are recomputed; inf: uncapped; None: off",
        Allowed.above(0).or_none().or_infinite(),
    )
    kl_beta: float = setting(
        0.0, "weight of the k3 KL to the initial policy (0: off)", Allowed.at_least(0)
    )
    entropy_coef: float = setting(0.0, "weight of an entropy bonus (0: off)", Allowed.at_least(0))
    policy_loss: str = setting(
        "ppo",
        "the policy term: 'ppo' (clipped token surrogate), 'gspo', 'gspo_token' or 'cispo'",
        Allowed.one_of(*POLICY_LOSSES),
    )
    eps_low_is: float = setting(
        1.0,
        "CISPO weight clipped below at 1 - eps_low_is",
        Allowed.between(0, 1).because("1: no lower bound"),
    )
    eps_high_is: float = setting(
        0.28, "CISPO weight clipped above at 1 + eps_high_is", Allowed.at_least(0)
    )
    icepop: tuple[float, float] | None = setting(
        None,
        "IcePop: drop tokens whose rho = pi_trainer / pi_behaviour leaves (a, b); a dropped "
        "token's policy term is 0",
        Allowed.ratio_band().or_none(),
    )
    mis: str | None = setting(
        None,
        "rejection sampling (MIS) on rho: 'token' (rho) or 'sequence' (its product); set with "
        "mis_bounds",
        Allowed.one_of(None, *MIS_LEVELS),
    )
    mis_bounds: tuple[float, float] | None = setting(
        None, "the (low, high) band of mis", Allowed.ratio_band().or_none()
    )
    geo_mask: tuple[float, float] | None = setting(
        None,
        "drop sequences whose exp(mean log rho) leaves (low, high)",
        Allowed.ratio_band().or_none(),
    )

    def __post_init__(self) -> None:
        for name in BOUNDED:
            value = getattr(self, name)
            if isinstance(value, list | tuple) and len(value) == 2:
                with contextlib.suppress(TypeError, ValueError):  # refused below, by name
                    object.__setattr__(self, name, tuple(float(v) for v in value))
        check_settings(self)
        require(
            (self.mis is None) == (self.mis_bounds is None),
            f"Loss.mis ({self.mis!r}) and Loss.mis_bounds ({self.mis_bounds!r}) are set "
            f"together: mis in {MIS_LEVELS} with mis_bounds = (low, high), or both None",
        )
        require(
            self.norm_constant is None or self.norm == "constant",
            f"Loss.norm_constant ({self.norm_constant!r}) is the divisor of norm 'constant'; "
            f"with norm {self.norm!r} leave it None",
        )

    def for_budget(self, max_new_tokens: int) -> PolicyLossConfig:
        """This config with norm 'constant''s divisor filled in from the generation budget
        (when unset): what a train step reads."""
        if self.norm != "constant" or self.norm_constant is not None:
            return self
        return dataclasses.replace(self, norm_constant=float(max_new_tokens))
