"""Training loop, checkpoints and metrics."""
