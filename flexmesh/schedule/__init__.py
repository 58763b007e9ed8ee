"""Per-step scheduling: split, pack and assign each global batch's sequences to groups of ranks.

The result is a step schedule (flexmesh.layout.step.StepSchedule); in this package "schedule" alone
means that, never the pipeline schedule. Modules, each importing only those listed before it:

- ``context`` (what a policy may ask the cost model), ``lower_bound``, ``packing`` (the one packer),
  ``bucketing``, ``dispatch`` (the one dispatch of items over groups by their costs);
- ``assemble``: group slots on ranks and :func:`~flexmesh.schedule.assemble.build_step_schedule`,
  which scores every policy's result the same way;
- ``placement`` (the Batch and Placement values) and ``assign`` (LPT and the balance pass on them);
- the policies: ``static`` (fixed, balanced), ``hdp``, then ``milp`` and ``chunking``, which build on them;
- ``registry``: the policy table and :func:`~flexmesh.schedule.registry.make_schedule`;
- ``groups``: a plan of several replica groups: each step's sequences dispatched over them, then a
  policy inside each, and each group's context;
- ``scheduler``: a plan's :class:`~flexmesh.schedule.scheduler.Scheduler` for the runtime;
- ``testing``: small contexts for tests and doctests.
"""
