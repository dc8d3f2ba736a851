"""jaxrl-orch: JAX-native asynchronous RL post-training."""
