"""The rollout dispatcher: ``dispatch.RolloutDispatcher`` (the component), its settings
(``settings``), its admitted groups in flight (``groups``) and the eager task start (``eager``).
Import the submodules; this package imports nothing."""
