"""The training loop: the trainer, its step, its extensions and monitors."""
