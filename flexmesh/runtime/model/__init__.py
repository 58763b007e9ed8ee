"""The model and its layers: plain PyTorch, no process groups."""
