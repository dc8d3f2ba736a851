"""Fixtures of the trainer tests (the tiny config and batches live in support.trainer_batches)."""

import pytest
from support.trainer_batches import TINY

from jaxrl_orch.models.transformer import ModelConfig


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return TINY
