"""Turn profiles into what the cost model takes: a ClusterSpec, a Hardware, a LayerTiming, a CostModel.

>>> from flexmesh.profile.format import CollectiveFit, HardwareProfile
>>> from flexmesh.spec import MODEL_PRESETS
>>> hw = HardwareProfile(device={"type": "cpu", "name": "Xeon", "nodes": 1, "devices_per_node": 2,
...                              "memory_bytes": 8 * 2**30}, dtype="fp32", matmul_flops_per_s={"fp32": 5e10},
...                      memory_bytes_per_s=1e10, attention={"fp32": {"flops_per_s": 2e10}},
...                      collectives=[CollectiveFit("all_reduce", 2, "intra", 3e-5, 1e-9)], name="hw.json")
>>> c = cluster_from_profile(hw, 4)
>>> c.label, c.device.memory_gib, c.device.peak_tflops
('4xXeon', 4.0, {'fp32': 0.05})
>>> cost = cost_model_from_profiles(MODEL_PRESETS["tiny"], hardware=hw, world=4)
>>> cost.source, cost.model.dtype, cost.memory_budget / 2**30
('profile:hw.json', 'fp32', 4.0)
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.training.model import CostModel
from flexmesh.errors import ProfileError, SpecError
from flexmesh.profile.format import HardwareProfile, ModelProfile, as_profile
from flexmesh.profile.timing import ProfiledHardware, ProfiledTiming
from flexmesh.spec.cluster import ClusterSpec, DeviceSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


def cluster_from_profile(hw: HardwareProfile, world: int | None = None) -> ClusterSpec:
    """One node of ``world`` devices (default: as many as were profiled) of the profiled device.

    The device's peak per dtype is the measured matmul throughput (so efficiencies are 1), its memory
    the profile's per device for ``world`` processes (on CPU: the RAM shared by them), its bandwidths
    and latencies those of the measured send/recv; the cost model reads the profile itself through
    :func:`hardware_from_profile`, so these fields only describe the device to people and files.
    """
    world = world or int(hw.device["nodes"]) * int(hw.device["devices_per_node"])
    if world < 1:
        raise ProfileError(f"world must be at least 1, got {world}")
    p2p = hw.fits("send_recv")
    alpha = min((f.alpha_s for f in p2p), default=0.0)
    gbps = max((1.0 / f.beta_s_per_byte / 1e9 for f in p2p if f.beta_s_per_byte > 0),
               default=float(hw.memory_bytes_per_s) / 1e9)
    matmul = {k: float(v) for k, v in hw.matmul_flops_per_s.items()}
    attn = hw.attention_flops(hw.dtype) / matmul[hw.dtype] if hw.dtype in matmul else 1.0
    try:
        dev = DeviceSpec(
            name=re.sub(r"[^A-Za-z0-9]+", "-", str(hw.device["name"])).strip("-") or "device",
            peak_tflops={k: v / 1e12 for k, v in matmul.items()},
            memory_gib=hw.memory_per_device(world) / GIB, hbm_gbps=float(hw.memory_bytes_per_s) / 1e9,
            nvlink_gbps=gbps, node_net_gbps=gbps, intra_latency_us=alpha * 1e6, inter_latency_us=alpha * 1e6,
            mm_efficiency=1.0, attn_efficiency=attn, intra_efficiency=1.0, inter_efficiency=1.0,
            a2a_intra_efficiency=1.0, a2a_inter_efficiency=1.0, framework_reserve_gib=0.0, allocator_headroom=0.0)
        return ClusterSpec(nodes=1, devices_per_node=world, device=dev)
    except SpecError as e:
        raise ProfileError(f"hardware profile {hw.name}: {e}; re-run `flexmesh profile hardware`") from None


def hardware_from_profile(cluster: ClusterSpec, profile: HardwareProfile, dtype: str | None = None) -> Hardware:
    """Throughput and collective times of ``cluster`` measured by ``flexmesh profile hardware``.

    ``dtype`` (default: the profile's, the dtype the runtime trains in on that device) picks the
    matmul and attention throughput; see :class:`~flexmesh.profile.timing.ProfiledHardware`.
    """
    return ProfiledHardware(cluster, profile, dtype or profile.dtype)


def cost_model_from_profiles(spec: ModelSpec, hardware=None, model=None, world: int | None = None,
                             cluster: ClusterSpec | None = None) -> CostModel:
    """A CostModel reading a hardware profile and/or a model profile (paths or loaded profiles).

    With a hardware profile the cluster is :func:`cluster_from_profile` of ``world`` devices unless
    ``cluster`` is given; without one, ``cluster`` is needed and its device preset prices compute
    and communication. Bytes are counted in the profiles' dtype (the model profile's, else the
    hardware profile's: the dtype the runtime trains in there), not the spec's.
    """
    hw: HardwareProfile | None = as_profile(hardware, "hardware") if hardware is not None else None
    mp: ModelProfile | None = as_profile(model, "model") if model is not None else None
    if cluster is None:
        if hw is None:
            raise ProfileError("give a hardware profile or a cluster to price the model on")
        cluster = cluster_from_profile(hw, world)
    # Bytes and throughput in the dtype the profiles measured: the one the runtime trains in.
    dtype = mp.dtype if mp is not None else (hw.dtype if hw is not None else spec.dtype)
    spec = replace(spec, dtype=dtype)
    hardware_model = hardware_from_profile(cluster, hw, dtype) if hw is not None else None
    return CostModel(spec, cluster, hardware=hardware_model, timing=ProfiledTiming(mp) if mp is not None else None)


# ``--cluster local`` or ``NxLOCAL``: N devices of this machine, priced by its saved profiles.
LOCAL = re.compile(r"(?:([1-9][0-9]*)x)?local", re.IGNORECASE)


def local_profile(kind: str, spec: ModelSpec | None = None, dtype: str | None = None,
                  cache_dir: str | Path | None = None) -> Path:
    """Where ``flexmesh profile`` saves this machine's ``kind`` ("hardware" or "model") profile: in
    flexmesh's cache folder (flexmesh.data.cache), a model's by its name and dtype.

    >>> local_profile("hardware", cache_dir="/c").as_posix()
    '/c/local/hardware.json'
    """
    from flexmesh.data.cache import cache_root

    root = cache_root(cache_dir) / "local"
    if kind == "hardware":
        return root / "hardware.json"
    assert spec is not None
    return root / f"model-{re.sub(r'[^A-Za-z0-9.-]+', '_', spec.name)}-{dtype or spec.dtype}.json"


def local_cost_model(spec: ModelSpec, cluster: str, hardware: str | None = None, model: str | None = None
                     ) -> CostModel | None:
    """The CostModel of ``--cluster local`` / ``NxLOCAL`` (None for any other cluster): this machine's
    saved hardware profile (or ``hardware``) for N devices (default: as many as it profiled), and its
    saved profile of this model when there is one (or ``model``)."""
    found = LOCAL.fullmatch(cluster.strip())
    if found is None:
        return None
    path = Path(hardware) if hardware else local_profile("hardware")
    if not path.is_file():
        raise ProfileError(f"--cluster {cluster} prices this machine by its saved profile, and there is none yet "
                           f"({path}): run `flexmesh profile hardware --nproc N` first (it saves one)")
    hw = as_profile(str(path), "hardware")
    if model is None:
        saved = [local_profile("model", spec, d) for d in (spec.dtype, hw.dtype)]
        model = next((str(p) for p in saved if p.is_file()), None)
    profiled = cluster_from_profile(hw, int(found.group(1)) if found.group(1) else None)
    # named "local", so a plan records a cluster that `train` prices the same way again
    named = replace(profiled, device=replace(profiled.device, name="local"))
    return cost_model_from_profiles(spec, hardware=hw, model=model, cluster=named)


def cost_model_for(spec: ModelSpec, cluster: str | None, hardware: str | None = None, model: str | None = None,
                   default_cluster: str | None = None) -> CostModel:
    """The CostModel the command-line flags describe: ``--cluster``, ``--hardware-profile``, ``--model-profile``.

    Without ``--cluster`` a hardware profile's node is the cluster (:func:`cluster_from_profile`),
    else ``default_cluster``; without profiles the cluster's presets price everything; ``local``
    clusters are priced by this machine's saved profiles (:func:`local_cost_model`).
    """
    from flexmesh.errors import SpecError
    from flexmesh.spec.cluster import parse_cluster

    local = local_cost_model(spec, cluster, hardware, model) if cluster is not None else None
    if local is not None:
        return local
    hw = as_profile(hardware, "hardware") if hardware else None
    spec_cluster: ClusterSpec | None = None
    if cluster is not None:  # an empty string is refused by parse_cluster, not taken for "no cluster"
        spec_cluster = parse_cluster(cluster)
    elif hw is None:
        if default_cluster is None:
            raise SpecError("give --cluster (e.g. 8xH100) or --hardware-profile (a file from `flexmesh profile "
                            "hardware`)")
        spec_cluster = parse_cluster(default_cluster)
    if hw is None and not model and spec_cluster is not None:
        return CostModel(spec, spec_cluster)
    return cost_model_from_profiles(spec, hardware=hw, model=model or None, cluster=spec_cluster)
