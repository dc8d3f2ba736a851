"""The composition root: the one place that builds the run's parts from its settings and wires
them (the model, data, placement, trainers, engines and their sides, the weight path, the
orchestrator). Import the submodules; this package imports nothing, so
``compose.orchestrator`` stays free of JAX."""
