"""How a trainer's samples become rows: ``RowLayout``.

What it owns: the row settings of a trainer (its length, a fixed count or a floor, the padding
token), their check against the model and the step's chunking (``floor``), and the packed batch
of a known row count as abstract arrays (``abstract_batch``), what the trainer compiles its step
for before the first batch exists. Packing itself is ``algorithms.packing``.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding

from jaxrl_orch.algorithms.packing import pack_samples
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.trainer.step import BATCH_FIELDS


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How samples become rows: ``row_len`` tokens a row; ``num_rows`` fixes the row count of
    every batch (None: as many as the batch needs), ``min_rows`` is its floor (rounded up to
    whole chunks), ``pad_id`` fills the padding."""

    row_len: int = 2048
    num_rows: int | None = None
    min_rows: int | None = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.row_len < 2:
            raise ValueError(
                f"row_len must be >= 2 (targets are shifted by one), got {self.row_len}"
            )

    def floor(self, model_config: ModelConfig, multiple: int) -> int:
        """Check the layout against the model and the step's chunking; returns the row floor
        rounded up to whole chunks (``multiple`` rows)."""
        if self.row_len > model_config.max_seq_len:
            raise ValueError(
                f"row_len {self.row_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
            )
        if self.num_rows is not None and self.num_rows % multiple:
            raise ValueError(
                f"num_rows {self.num_rows} must be a multiple of chunk_rows * minibatches = "
                f"{multiple}"
            )
        return -(-(self.min_rows or 0) // multiple) * multiple

    def abstract_batch(
        self, rows: int, shardings: dict[str, NamedSharding]
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """A packed batch of ``rows`` rows as abstract arrays placed on ``shardings`` (the
        step's ``batch_shardings``), with the types packing gives each field."""
        empty = pack_samples([], self.row_len, num_rows=rows, pad_id=self.pad_id)
        fields = {k: getattr(empty, k) for k in BATCH_FIELDS}
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
            for k, v in fields.items()
        }
