"""The run's settings as data: ``train.TrainConfig`` (what ``python -m jaxrl_orch.train`` is
bound with, in sections), ``orchestrator.OrchestratorConfig`` (the loop's own settings, derived
from it), and ``listing`` (``--list_config``). Pure: no JAX, nothing that builds a part."""
