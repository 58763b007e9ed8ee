"""Inference pricing on the device layer (torch-free).

- :mod:`.timing`: the interface, :class:`~.timing.IterationTiming` (one engine iteration over a batch of
  ``(tokens in the KV cache, tokens computed now)`` per request);
- :mod:`.analytic`: its implementation from the device layer's kernels and collectives;
- :mod:`.memory`: KV bytes per token and KV capacity;
- :mod:`.overhead`: the per-iteration engine overhead (a named term, from a profile);
- :mod:`.engine_rates`: an engine's own kernels' rates on the device layer's (named factors, fitted from an
  engine's measurements; none by default);
- :mod:`.transfer`: KV transfer between replicas over the cluster's links.
"""
