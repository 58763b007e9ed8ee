"""Hardware and model profilers, the profile files they write, and the cost model that reads them.

- :func:`profile_hardware` / :func:`profile_model` measure (``flexmesh profile hardware|model``);
- :func:`load_profile` reads a file (:class:`HardwareProfile` or :class:`ModelProfile`);
- :func:`cost_model_from_profiles` / :func:`cluster_from_profile` / :func:`hardware_from_profile` turn them
  into a CostModel (reading them through :mod:`flexmesh.profile.timing`).

File format: docs/profiles.md. The profilers import torch; loading and using profiles does not
need it beyond what the cost model needs.
"""

from flexmesh.profile.fit import LayerFit, fit_alpha_beta, fit_layer_time, fit_linear
from flexmesh.profile.format import CollectiveFit, HardwareProfile, ModelProfile, load_profile, spec_hash
from flexmesh.profile.timing import ProfiledHardware, ProfiledTiming
from flexmesh.profile.use import cluster_from_profile, cost_model_from_profiles, hardware_from_profile


def profile_hardware(*args, **kwargs):
    """See :func:`flexmesh.profile.hardware.profile_hardware` (imported on first use: it needs torch)."""
    from flexmesh.profile.hardware import profile_hardware as run

    return run(*args, **kwargs)


def profile_model(*args, **kwargs):
    """See :func:`flexmesh.profile.model.profile_model` (imported on first use: it needs torch)."""
    from flexmesh.profile.model import profile_model as run

    return run(*args, **kwargs)


__all__ = [
    "CollectiveFit", "HardwareProfile", "LayerFit", "ModelProfile", "ProfiledHardware", "ProfiledTiming",
    "cluster_from_profile", "cost_model_from_profiles", "fit_alpha_beta", "fit_layer_time", "fit_linear",
    "hardware_from_profile", "load_profile", "profile_hardware", "profile_model", "spec_hash",
]
