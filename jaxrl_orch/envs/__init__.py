"""Environments: run and score rollouts, talking to the model only through an InferenceClient.

``make_env(name, **kwargs)`` builds a bundled env (``reverse_text``, ``arithmetic``,
``calculator``) or one added with ``register_env``. See ``base.py`` for the trace invariants.
"""

from jaxrl_orch.envs.base import env_names, make_env, register_env

__all__ = ["env_names", "make_env", "register_env"]
