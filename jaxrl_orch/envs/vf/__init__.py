"""verifiers 0.4 environments in the loop (the ``verifiers`` extra; docs/design.md section 10).

``env.VerifiersEnv`` loads any verifiers environment from the dict its users write and runs its
episodes; ``bridge.EngineBridge`` is the engine route verifiers' training client calls;
``traces.episode_rollout`` turns a finished trace into a rollout, exactly or not at all.
Importing this package imports nothing of verifiers; its modules do, when an env is built.
"""
