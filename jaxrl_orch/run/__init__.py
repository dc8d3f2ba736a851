"""The run's stages (warm-up, RL or its imitation control, final eval, export), driven in order
by ``experiment``, and the run's outputs: history on disk, summary, telemetry writers."""
