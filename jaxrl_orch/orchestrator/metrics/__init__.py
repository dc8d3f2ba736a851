"""Where step rows, eval rows and gauge snapshots are written: ``writers`` (console, progress
bar, JSON lines, TensorBoard) and ``wandb`` (the optional Weights & Biases writer)."""
