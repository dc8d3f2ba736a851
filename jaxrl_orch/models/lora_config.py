"""``LoraConfig``: which projections carry LoRA adapters, their rank and scale, and whether the
frozen base is held quantized (QLoRA), declared once on its fields (``jaxrl_orch.settings``).

The run binds it as the ``Lora`` section (``Lora.rank = 16``), read as it is by the RL trainer's
model (``ModelConfig.lora``), every engine replica's merge and the export; ``rank`` 0 is a run
without adapters (every weight trains). ``TARGETS`` is the one table of the projections an
adapter may sit on: its keys are the names a config uses, its values where ``models.lora``
finds each projection and how the HF checkpoint names it.

Free of JAX, so the config can declare its sections without importing the model.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxrl_orch.settings import Allowed, check_settings, require, setting

# Target name -> (module attribute path under a block, contracted leading axes of W, HF name).
TARGETS: dict[str, tuple[tuple[str, str], int, str]] = {
    "q": (("attn", "q_proj"), 1, "self_attn.q_proj"),
    "k": (("attn", "k_proj"), 1, "self_attn.k_proj"),
    "v": (("attn", "v_proj"), 1, "self_attn.v_proj"),
    "o": (("attn", "o_proj"), 2, "self_attn.o_proj"),
    "gate": (("mlp", "gate_proj"), 1, "mlp.gate_proj"),
    "up": (("mlp", "up_proj"), 1, "mlp.up_proj"),
    "down": (("mlp", "down_proj"), 1, "mlp.down_proj"),
}
QUANTIZE = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """See the module docstring."""

    SECTION: ClassVar[str] = "Lora"

    rank: int = setting(
        0,
        "adapter rank; 0: no adapters, the RL stage trains every weight",
        Allowed.at_least(0).because("0 trains every weight"),
    )
    alpha: float = setting(32.0, "an adapter's output is scaled by alpha / rank", Allowed.above(0))
    targets: tuple[str, ...] = setting(
        tuple(TARGETS),
        "the projections that get adapters: attention q, k, v, o and MLP gate, up, down",
        Allowed.some_of(*TARGETS),
    )
    quantize: str | None = setting(
        None,
        "QLoRA: the trainer's frozen base held as int8 or int4 (models/qlora.py); None: as loaded",
        Allowed.one_of(None, *QUANTIZE),
    )

    def __post_init__(self) -> None:
        if isinstance(self.targets, list):  # gin gives lists: stored hashable
            object.__setattr__(self, "targets", tuple(self.targets))
        check_settings(self)
        require(
            self.quantize is None or self.rank > 0,
            f"Lora.quantize = {self.quantize!r} quantizes a LoRA run's frozen base; set "
            f"Lora.rank > 0 (got {self.rank}) or Lora.quantize = None",
        )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
