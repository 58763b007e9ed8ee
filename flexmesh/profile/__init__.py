"""Hardware and model profilers, the profile files they write, and the cost model that reads them.

- :func:`profile_hardware` / :func:`profile_model` measure (``flexmesh profile hardware|model``);
- :func:`load_profile` reads a file (:class:`HardwareProfile` or :class:`ModelProfile`);
- :func:`cost_model_from_profiles` / :func:`cluster_from_profile` turn them into a CostModel.

File format: docs/profiles.md. The profilers import torch; loading and using profiles does not
need it beyond what the cost model needs.
"""

from flexmesh.profile.fit import LayerFit, fit_alpha_beta, fit_layer_time, fit_linear
from flexmesh.profile.format import CollectiveFit, HardwareProfile, ModelProfile, load_profile, spec_hash
from flexmesh.profile.use import cluster_from_profile, cost_model_from_profiles


def profile_hardware(*args, **kwargs):
    """See :func:`flexmesh.profile.hardware.profile_hardware` (imported on first use: it needs torch)."""
    from flexmesh.profile.hardware import profile_hardware as run

    return run(*args, **kwargs)


def profile_model(*args, **kwargs):
    """See :func:`flexmesh.profile.model.profile_model` (imported on first use: it needs torch)."""
    from flexmesh.profile.model import profile_model as run

    return run(*args, **kwargs)


__all__ = [
    "CollectiveFit", "HardwareProfile", "LayerFit", "ModelProfile", "cluster_from_profile", "cost_model_from_profiles",
    "fit_alpha_beta", "fit_layer_time", "fit_linear", "load_profile", "profile_hardware", "profile_model", "spec_hash",
]
