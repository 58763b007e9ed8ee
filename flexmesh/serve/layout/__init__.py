"""Serving's ground floor: its vocabulary as plain, torch-free data that everything above reads and nothing here
simulates, plans or runs.

- :mod:`.roles`: a replica's role (aggregated, prefill, decode);
- :mod:`.knobs`: what an engine is started with (vLLM's names) and vLLM's defaults per device;
- :mod:`.replicas`: replicas (tp x pp, role) written as ``2xtp4-prefill@H100`` and placed on a cluster;
- :mod:`.classes`: requests classed by length, the one classing of a plan's buckets and its router;
- :mod:`.buckets`: a workload's length buckets, each with its share and lengths;
- :mod:`.routing`: the routing table: per class, each replica's share of new requests and of hand-offs;
- :mod:`.slo`: latency bounds;
- :mod:`.quality`: a cascade's quality curve and which requests escalate;
- :mod:`.plan`: the serving plan, its groups and its versioned JSON file.
"""
