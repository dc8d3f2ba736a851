"""The rollout dispatcher: ``dispatch.RolloutDispatcher`` (the component), its settings
(``settings``), what it starts next (``admission``), the pending evals (``evals``), starting
and releasing admitted rollouts (``launch``), its groups in flight (``groups``) and the eager
task start (``eager``). Import the submodules; this package imports nothing."""
