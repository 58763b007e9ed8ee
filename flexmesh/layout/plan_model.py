"""The model a plan runs with: ``--model`` when given, else the one the plan records -- found again.

A plan names its model (``model``: a preset, ``gpt:...``, or the name a config.json gave it) and,
when it was made from a config.json, records that file (``model_config``: its absolute path and
sha256, :class:`~flexmesh.spec.model_file.ModelFile`). ``flexmesh train``, ``simulate`` and
``plan --check`` resolve the model through :func:`plan_model`:

- no ``--model``: the recorded file, from any working folder; refused when it is gone or its content
  changed since the plan was made (the plan was checked against the old content);
- ``--model`` a copy of the recorded file (same sha256, any path): the plan's model;
- ``--model`` the recorded path with other content: refused, except by ``plan --check`` (``recheck``),
  which validates the plan against the file as it is now (and ``--out`` records it);
- ``--model`` another model under the plan's model name (a preset ``tiny`` for a plan made from a
  folder ``tiny``): refused. A config.json always means that config, never the preset of its name.

Plans without ``model_config`` (of presets, or written before it existed) resolve ``model`` with
:func:`~flexmesh.spec.model.parse_model`, as before.
"""

from __future__ import annotations

from dataclasses import replace

from flexmesh.errors import PlanError, SpecError
from flexmesh.layout.plan import Plan
from flexmesh.spec.model import ModelSpec, from_hf_config, parse_model, precision_suffix
from flexmesh.spec.model_file import ModelFile


def model_shape(spec: ModelSpec) -> dict:
    """What makes two models the same for a plan: every field but the name and the dtype."""
    return {k: v for k, v in spec.to_dict().items() if k not in ("name", "dtype")}


def shape_diff(a: ModelSpec, b: ModelSpec) -> str:
    """The first three fields where ``a`` and ``b`` differ, ``"hidden 256 vs 512; ..."``."""
    mine = model_shape(a)
    return "; ".join([f"{k} {mine.get(k)} vs {v}" for k, v in model_shape(b).items() if mine.get(k) != v][:3])


def recorded_model(plan: Plan) -> ModelSpec | None:
    """The model ``plan`` was made for, where it can be read here: its ``model_config`` file while its
    content is the recorded one (named as the plan names it), else for a plan without one its ``model``
    (a preset, ``gpt:...`` or a config path); None otherwise."""
    mf = plan.model_config
    try:
        if mf is None:
            return parse_model(plan.model)
        spec = from_hf_config(mf.path)
        precision = precision_suffix(plan.model)
        return replace(spec, name=plan.model, dtype=precision or spec.dtype) if mf.current() == mf.sha256 else None
    except SpecError:
        return None


def _changed(mf: ModelFile, plan: Plan, where: str, now: str) -> PlanError:
    """The error for recorded file ``mf`` whose content (sha256 ``now``) is not what plan ``where`` recorded."""
    try:
        layers = from_hf_config(mf.path).num_layers
        more = f"; it now has {layers} layers, the plan {plan.num_layers}" if layers != plan.num_layers else ""
    except SpecError as e:
        more = f"; it no longer reads: {e}"
    return PlanError(f"model config {mf.path} has changed since plan {where} was made from it (sha256 now "
                     f"{now[:12]}, the plan recorded {mf.sha256[:12]}{more}); restore it, or check the plan against "
                     f"it and record it: flexmesh plan --check {where} --model {mf.path} --out {where}")


def plan_model(plan: Plan, model: str | None, where: str, recheck: bool = False) -> ModelSpec:
    """The model to run ``plan`` (read from file ``where``) with: ``model`` (``--model``) if given, else
    the one the plan records; one-line errors as the module doc lists. ``recheck`` (``plan --check``)
    takes the recorded file with new content when ``model`` names it."""
    mf = plan.model_config
    if model is None:
        if mf is None:
            try:
                return parse_model(plan.model)
            except SpecError as e:
                raise SpecError(f"plan {where} names model {plan.model!r} and records no config file ({e}); pass "
                                "--model with the preset or config.json it was made for") from None
        now = mf.current()
        if now is None:
            raise PlanError(f"plan {where} was made from model config {mf.path}, which does not exist (here); pass "
                            "--model with that config.json (a copy of it anywhere)")
        if now != mf.sha256:
            raise _changed(mf, plan, where, now)
        spec = from_hf_config(mf.path)
        precision = precision_suffix(plan.model)
        return replace(spec, name=plan.model, dtype=precision or spec.dtype)
    spec = parse_model(model)
    if mf is None:
        return spec  # check_model compares it with the plan's preset (or config path)
    given = ModelFile.of(model)
    if given is not None and given.sha256 == mf.sha256:
        return replace(spec, name=plan.model)  # the plan's config, wherever it lies now
    if given is not None and given.path == mf.path:
        if recheck:
            return spec
        raise _changed(mf, plan, where, given.sha256)
    recorded = recorded_model(plan)
    if spec.name == plan.model and (recorded is None or model_shape(recorded) != model_shape(spec)):
        what = shape_diff(recorded, spec) if recorded is not None else "which is not here to compare with"
        raise PlanError(f"--model {model} is not the model {plan.model!r} plan {where} was made from ({mf.path}; "
                        f"{what}), though of the same name; pass --model {mf.path}, or re-plan for {model}")
    return spec
