"""The deployment planner (``flexmesh serve plan``): the cheapest deployment that meets the SLO on the GPUs one can
get, torch-free. docs/serve-plan.md has the whole story; each module holds one step:

The serving plan itself, its length buckets, routing table and quality curve are plain data on serving's ground
floor (:mod:`flexmesh.serve.layout`); here is what makes and judges them:

- :mod:`.workload`: a workload as length buckets (each bucket's share, lengths, longest request);
- :mod:`.capacity`: replica configurations (device group, tp x pp, role, engine knobs) that fit memory, and
  each one's capacity per bucket at the SLO, from the inference cost terms;
- :mod:`.milp`: the mixed-integer program over replica counts, routing per bucket, prefill-to-decode flows
  over the links, availability and budget (SciPy's HiGHS);
- :mod:`.check`: a plan checked against its models and cluster (devices, degrees, memory, the longest request);
- :mod:`.score`: a plan simulated on a workload (its goodput, by the serving simulator);
- :mod:`.search`: the planner: MILP candidates, re-scored by the simulator, repaired by local moves;
- :mod:`.baselines`: the plans the planner is compared with, each scored the same way;
- :mod:`.replan`: re-planning when a group is lost or the workload shifts, and a full re-plan's transition;
- :mod:`.cascade`: a cascade of models and its escalation, chosen together (the quality curve:
  :mod:`flexmesh.serve.layout.quality`).
"""
