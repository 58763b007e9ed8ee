"""Inference pricing on the device layer (torch-free).

- :mod:`.timing`: the interface, :class:`~.timing.IterationTiming` (one engine iteration over a batch of
  ``(tokens in the KV cache, tokens computed now)`` per request);
- :mod:`.analytic`: its implementation from the device layer's kernels and collectives;
- :mod:`.memory`: KV bytes per token and KV capacity;
- :mod:`.overhead`: the per-iteration engine overhead (a named term, from a profile);
- :mod:`.transfer`: KV transfer between replicas over the cluster's links.
"""
