"""The settings of the off-policy corrections (``corrections``), free of JAX: the loss's
``PolicyLossConfig`` and the config's ``RL`` section check them with the same code, so a bad
value is refused with one message wherever it is set."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")
MIS_LEVELS = ("token", "sequence")
BOUNDED = ("icepop", "mis_bounds", "geo_mask")


def check_bounds(name: str, value: Sequence[float] | None) -> tuple[float, float] | None:
    """``value`` as a ``(low, high)`` float pair with ``0 <= low < high``, or None."""
    if value is None:
        return None
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        low, high = math.nan, math.nan
    if not 0.0 <= low < high:
        raise ValueError(
            f"{name} must be None (off) or a pair (low, high) of ratios with 0 <= low < high, "
            f"got {value!r}"
        )
    return low, high


def check_settings(cfg: Any, prefix: str = "") -> None:
    """The checks of the correction fields of ``cfg`` (``PolicyLossConfig``, or the config's
    ``RL`` section with ``prefix="RL."``): each error names the setting, the value and what is
    allowed."""
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(
            f"{prefix}policy_loss must be one of {POLICY_LOSSES}, got {cfg.policy_loss!r}"
        )
    if not 0.0 <= cfg.eps_low_is <= 1.0:
        raise ValueError(
            f"{prefix}eps_low_is must be in [0, 1] (1: no lower bound), got {cfg.eps_low_is!r}"
        )
    if not cfg.eps_high_is >= 0.0:
        raise ValueError(f"{prefix}eps_high_is must be >= 0, got {cfg.eps_high_is!r}")
    if cfg.mis not in (None, *MIS_LEVELS):
        raise ValueError(f"{prefix}mis must be one of {(None, *MIS_LEVELS)}, got {cfg.mis!r}")
    if (cfg.mis is None) != (cfg.mis_bounds is None):
        raise ValueError(
            f"{prefix}mis ({cfg.mis!r}) and {prefix}mis_bounds ({cfg.mis_bounds!r}) are set "
            f"together: mis in {MIS_LEVELS} with mis_bounds = (low, high), or both None"
        )
    for name in BOUNDED:
        check_bounds(prefix + name, getattr(cfg, name))
