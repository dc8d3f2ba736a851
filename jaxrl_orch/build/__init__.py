"""The composition root's builders: the settings parts are built with (``parts``) and the
orchestrator with its components wired together (``orchestrator``). Import the submodules;
this package imports nothing, so ``build.orchestrator`` stays free of JAX."""
