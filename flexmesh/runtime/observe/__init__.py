"""What a run observes of itself: the activation memory autograd keeps, where its wall time went, and which
rank stopped answering. Plain measurements the training loop and the profilers use; they import no other wing."""
