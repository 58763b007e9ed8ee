"""A run's state on disk: checkpoints, weights, export, the run folder."""
