"""The device catalogue: DeviceSpec, the presets of presets/devices.toml, and driver names to presets.

Every entry cites its datasheet; a part without an end-to-end fit takes its family's fitted
efficiencies, its GEMM and attention efficiencies scaled by measured kernel tables
(:func:`catalogue_efficiency`; ``python -m flexmesh.cost.device.gemm_tables`` and ``python -m
flexmesh.cost.device.attention_tables`` redo the tables' medians).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from importlib import resources

import tomllib

from flexmesh.errors import SpecError
from flexmesh.spec.limits import MAX_RATE, MAX_SPEED, MIN_FRACTION, MIN_RATE
from flexmesh.spec.values import number, whole
from flexmesh.units import GIB

# What joins the GPUs of a node (presets/devices.toml explains each).
INTRA_LINKS = ("nvswitch", "nvlink-bridge", "nvlink-mesh", "pcie")
# What a device name may hold: it is written into launch scripts, file names and command lines (a defined set, so
# that nothing it carries is read as a command or a path anywhere it lands)
DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def device_name(name: object, where: str = "device name", error: type[Exception] = SpecError) -> str:
    """``name`` if it is a device name (:data:`DEVICE_NAME`), else one line saying what one may hold."""
    if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
        raise error(f"{where} {name!r} is not a device name: letters, digits, '.', '_' and '-', at most 64, starting "
                    "with a letter or digit")
    return name


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type: datasheet numbers plus fitted efficiencies (see presets/devices.toml)."""

    name: str
    peak_tflops: dict[str, float]
    memory_gib: float
    hbm_gbps: float
    nvlink_gbps: float
    node_net_gbps: float
    intra_latency_us: float
    inter_latency_us: float
    mm_efficiency: float
    attn_efficiency: float
    intra_efficiency: float
    inter_efficiency: float
    a2a_intra_efficiency: float
    a2a_inter_efficiency: float
    framework_reserve_gib: float
    allocator_headroom: float
    # What the catalogue (presets/devices.toml) says beyond the numbers above; a device table in a
    # cluster file may leave them out: SM count unknown (no tile quantization), every GPU of a node
    # on NVLink.
    architecture: str = ""
    sms: int | None = None
    intra_link: str = "nvswitch"
    nvlink_domain: int = 0  # GPUs of a node NVLink joins; 0: all of them
    pcie_gbps: float = 0.0  # per GPU per direction, for collectives beyond the NVLink domain
    # Achieved fraction of pcie_gbps by NCCL collectives over PCIe (beyond the NVLink domain); 0: intra_efficiency
    pcie_efficiency: float = 0.0
    source: str = ""  # the datasheet the numbers come from
    efficiency_source: str = ""  # where mm_efficiency and attn_efficiency come from
    # The measured NCCL table (presets/collectives.toml) that prices ring collectives inside a node; ""
    # for none (then nvlink_gbps x intra_efficiency and intra_latency_us do).
    comm_table: str = ""
    # The device layer's kernels as the measured tables time them (devices.toml [gemm_kernels] and
    # [attention_kernels] of the system ``kernel_table`` names): a single GEMM's and a single fused attention's
    # fraction of peak. None: no kernel fit (a cluster file's device table without a base): the fits above.
    kernel_table: str = ""
    # The GEMM fit (devices.toml [gemm_kernels]) measured on this part itself where its kernel_table timed another
    # part (DeepBench's V100 and T4 GEMM tables: flexmesh.cost.device.gemm_tables.DEEPBENCH); "": kernel_table's
    gemm_table: str = ""
    kernel_mm_efficiency: float | None = None
    kernel_attn_efficiency: float | None = None
    # TFLOP/s per dtype of a large GEMM (4096^3) measured under sustained load on a part whose power cap holds its
    # clock below the boost clock the datasheet peak assumes (the T4 at 70 W, the L4 at 72 W); the device layer's
    # matmul and attention rates are scaled down to it (flexmesh.cost.device.hardware.Hardware.power_cap). Empty: the
    # peak holds.
    sustained_tflops: dict = field(default_factory=dict, compare=False)
    sustained_source: str = ""

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        device_name(self.name)
        if not isinstance(self.peak_tflops, dict) or not self.peak_tflops:
            raise SpecError(f"{where}: peak_tflops must be a table of dtype = TFLOP/s, e.g. {{bf16 = 312.0}}")
        for dtype, v in self.peak_tflops.items():
            number(v, f"{where}: peak_tflops.{dtype}", SpecError, MIN_RATE, strict=False, maximum=MAX_RATE)
        for f in ("memory_gib", "hbm_gbps", "nvlink_gbps", "node_net_gbps"):
            number(getattr(self, f), f"{where}: {f}", SpecError, MIN_RATE, strict=False, maximum=MAX_RATE)
        for f in ("intra_latency_us", "inter_latency_us", "framework_reserve_gib"):
            number(getattr(self, f), f"{where}: {f}", SpecError, strict=False)
        # Fractions of a datasheet peak that NCCL and the matmul kernels achieve: in (0, 1].
        for f in ("mm_efficiency", "intra_efficiency", "inter_efficiency", "a2a_intra_efficiency",
                  "a2a_inter_efficiency"):
            number(getattr(self, f), f"{where}: {f}", SpecError, MIN_FRACTION, strict=False, maximum=1.0)
        # Attention's achieved fraction of the matmul peak; a profiled device may run attention faster
        # than its measured matmuls, so only positive and finite.
        number(self.attn_efficiency, f"{where}: attn_efficiency", SpecError, MIN_FRACTION, strict=False,
               maximum=MAX_SPEED)
        for f in ("kernel_mm_efficiency", "kernel_attn_efficiency"):
            if getattr(self, f) is not None:
                number(getattr(self, f), f"{where}: {f}", SpecError, MIN_FRACTION, strict=False, maximum=1.0)
        number(self.allocator_headroom, f"{where}: allocator_headroom", SpecError, strict=False, maximum=0.99)
        if self.sms is not None:
            whole(self.sms, f"{where}: sms", SpecError)
        whole(self.nvlink_domain, f"{where}: nvlink_domain", SpecError, minimum=0)
        number(self.pcie_gbps, f"{where}: pcie_gbps", SpecError, strict=False)
        number(self.pcie_efficiency, f"{where}: pcie_efficiency", SpecError, strict=False, maximum=1.0)
        if not isinstance(self.sustained_tflops, dict):
            raise SpecError(f"{where}: sustained_tflops must be a table of dtype = TFLOP/s, e.g. {{fp16 = 24.0}}")
        for dtype, v in self.sustained_tflops.items():
            number(v, f"{where}: sustained_tflops.{dtype}", SpecError, MIN_RATE, strict=False, maximum=MAX_RATE)
        if self.intra_link not in INTRA_LINKS:
            raise SpecError(f"{where}: intra_link must be one of {', '.join(INTRA_LINKS)}, got {self.intra_link!r}")
        if self.comm_table and self.comm_table not in COMM_TABLES:
            raise SpecError(f"{where}: comm_table must be one of {', '.join(COMM_TABLES)} or empty, "
                            f"got {self.comm_table!r}")
        if self.nvlink_domain > 0 and self.pcie_gbps <= 0:
            raise SpecError(f"{where}: nvlink_domain {self.nvlink_domain} needs pcie_gbps, the bandwidth of "
                            "collectives over more GPUs of a node than NVLink joins")

    @property
    def framework_mm(self) -> float:
        """What a training step's GEMMs reach of the kernel rate, ``mm_efficiency / kernel_mm_efficiency``: the
        end-to-end fit's launch gaps, stream waits and non-GEMM work, a term above the device layer (1 without a
        kernel fit)."""
        return self.mm_efficiency / self.kernel_mm_efficiency if self.kernel_mm_efficiency else 1.0

    @property
    def framework_attn(self) -> float:
        """What a training step's attention reaches of the kernel rate, ``attn_efficiency /
        kernel_attn_efficiency`` (the fit also prices the backward, which the tables do not time)."""
        return self.attn_efficiency / self.kernel_attn_efficiency if self.kernel_attn_efficiency else 1.0

    def __hash__(self) -> int:  # dict field: hash by name and memory, enough to key caches
        return hash((self.name, self.memory_gib, self.mm_efficiency))

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes of tensors the planner may place: capacity less the framework reserve (the CUDA
        context, which the allocator does not see), over ``1 + allocator_headroom`` (the caching
        allocator's fragmentation, a fraction of the bytes it hands out). The one budget formula."""
        return max(0.0, self.memory_gib - self.framework_reserve_gib) / (1.0 + self.allocator_headroom) * GIB

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            arch = f" ({self.architecture} has no {dtype} Tensor Cores)" if self.architecture else ""
            others = [d for d in ("bf16", "fp16", "fp32") if d in self.peak_tflops]
            raise SpecError(f"device {self.name} cannot train in {dtype}{arch}; plan the model in "
                            f"{' or '.join(others)} instead: append @{others[0]} to --model "
                            f"(e.g. llama2-7b@{others[0]})")
        return self.peak_tflops[dtype] * 1e12

    def intra_node_gbps(self, gpus: int) -> float:
        """Bandwidth per GPU per direction of a collective over ``gpus`` GPUs of one node: NVLink's
        within the NVLink domain, PCIe's beyond it (bridged pairs, PCIe-only nodes)."""
        if self.nvlink_domain and gpus > self.nvlink_domain:
            return self.pcie_gbps
        return self.nvlink_gbps



@dataclass(frozen=True)
class KernelTable:
    """A measured kernel table's median bf16 throughput (GEMMs or causal attention) and its part's
    datasheet peak (devices.toml)."""

    tflops: float
    peak_tflops: float
    architecture: str
    hbm_gbps: float = 0.0  # the measured part's datasheet memory bandwidth
    sms: int | None = None  # the measured part's SM count (GEMM tables: the measured form's waves)

    @property
    def efficiency(self) -> float:
        return self.tflops / self.peak_tflops


def catalogue_efficiency(fit: float, table: KernelTable, fitted_table: KernelTable) -> float:
    """A part's GEMM or attention efficiency: the one fitted on another part, scaled by how the part's
    measured kernels compare with the fitted part's, each as a fraction of its own peak.

    >>> b200, h100 = KernelTable(1564.6, 2250.0, "blackwell"), KernelTable(786.9, 989.5, "hopper")
    >>> round(catalogue_efficiency(0.70, b200, h100), 3)
    0.612
    """
    return fit * table.efficiency / fitted_table.efficiency


def _load_comm_tables() -> dict[str, dict[str, dict[int, tuple[tuple[float, ...], tuple[float, ...]]]]]:
    """presets/collectives.toml: per system, op and GPU count, (bytes, seconds) with the seconds made
    non-decreasing in bytes (a larger message never takes less time than a smaller one padded to it;
    the tables' smallest sizes wobble by a microsecond)."""
    raw = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/collectives.toml").read_text())
    out: dict[str, dict[str, dict[int, tuple[tuple[float, ...], tuple[float, ...]]]]] = {}
    for system, ops in raw.items():
        for op, by_n in ops.items():
            if not isinstance(by_n, dict):
                continue  # the table's path
            for n, curve in by_n.items():
                seconds, least = [], 0.0
                for us in curve["us"]:
                    least = max(least, us * 1e-6)
                    seconds.append(least)
                out.setdefault(system, {}).setdefault(op, {})[int(n)] = (tuple(curve["bytes"]), tuple(seconds))
    return out


COMM_TABLES = _load_comm_tables()
_CATALOGUE = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/devices.toml").read_text())
GEMM_TABLES: dict[str, KernelTable] = {k: KernelTable(**v) for k, v in _CATALOGUE["gemm_tables"].items()}
ATTENTION_TABLES: dict[str, KernelTable] = {k: KernelTable(**v) for k, v in _CATALOGUE["attention_tables"].items()}
# The device layer's kernel constants per measured system, fitted to its tables (flexmesh.cost.device.gemm_tables
# and attention_tables, --fit): efficiency is a fraction of the measured part's peak
GEMM_KERNELS: dict[str, dict[str, float]] = _CATALOGUE.get("gemm_kernels", {})
ATTENTION_KERNELS: dict[str, dict[str, float]] = _CATALOGUE.get("attention_kernels", {})
# and decode attention's (flexmesh.cost.device.decode_tables --fit): hbm_fraction of the measured part's bandwidth
DECODE_KERNELS: dict[str, dict[str, float]] = _CATALOGUE.get("decode_kernels", {})
# FlashAttention-2's measured throughput and fit per architecture where it is not the fused kernel the
# tables measured (devices.toml [flash_attention_2]; flexmesh.cost.device.flash2)
FLASH2: dict[str, dict] = _CATALOGUE["flash_attention_2"]
# Attention's efficiency is fitted on one part (FlexSP's A100, flexmesh.cost.training.calibrate.fit_attn_efficiency):
# that family's value, its kernel tables those of the fitted part.
ATTENTION_FIT_FAMILY = "A100"
_DATASHEET = ("memory_gib", "hbm_gbps", "nvlink_gbps", "node_net_gbps", "intra_latency_us", "inter_latency_us",
              "architecture", "sms", "intra_link", "nvlink_domain", "pcie_gbps", "source")
_OPTIONAL = ("comm_table", "kernel_table", "gemm_table", "pcie_efficiency")


def _load_presets() -> dict[str, DeviceSpec]:
    raw = {k: v for k, v in _CATALOGUE.items() if k not in ("efficiency", "memory", "gemm_tables", "attention_tables",
                                                         "flash_attention_2", "gemm_kernels", "attention_kernels",
                                                         "decode_kernels")}
    eff, mem = _CATALOGUE["efficiency"], _CATALOGUE["memory"]
    attn_fit = eff[ATTENTION_FIT_FAMILY]
    out = {}
    for name, d in raw.items():
        e = {k: v for k, v in eff[d["family"]].items() if k != "kernel_table"}
        table, own = d["kernel_table"], eff[d["family"]]["kernel_table"]
        fit = f"{d['family']} fit (flexmesh.cost.training.calibrate)"
        gemm = d.get("gemm_table", table)
        if GEMM_TABLES[table].architecture != d["architecture"] and gemm == table:
            fit = f"assumed: no measured {d['architecture']} kernels, so the {fit} as it is"
        if table != own:
            e["mm_efficiency"] = catalogue_efficiency(e["mm_efficiency"], GEMM_TABLES[table], GEMM_TABLES[own])
            fit += f" x measured GEMMs of {table} / {own} (aiconfigurator-core, flexmesh.cost.device.gemm_tables)"
        if gemm != table:  # its own GEMM table: the same framework term over its own kernels' rate
            e["mm_efficiency"] *= GEMM_KERNELS[gemm]["efficiency"] / GEMM_KERNELS[table]["efficiency"]
            fit += f" x its GEMM fit's efficiency / {table}'s ({gemm}, flexmesh.cost.device.gemm_tables.DEEPBENCH)"
        e["attn_efficiency"] = catalogue_efficiency(attn_fit["attn_efficiency"], ATTENTION_TABLES[table],
                                                    ATTENTION_TABLES[attn_fit["kernel_table"]])
        if table != attn_fit["kernel_table"]:
            fit += (f"; attention: {ATTENTION_FIT_FAMILY} fit x measured attention of {table} / "
                    f"{attn_fit['kernel_table']} (flexmesh.cost.device.attention_tables)")
        e["efficiency_source"] = fit
        if gemm in GEMM_KERNELS:
            e["kernel_mm_efficiency"] = GEMM_KERNELS[gemm]["efficiency"]
        if table in ATTENTION_KERNELS:
            e["kernel_attn_efficiency"] = ATTENTION_KERNELS[table]["efficiency"]
        out[name] = DeviceSpec(
            name=name,
            peak_tflops={k.removeprefix("peak_tflops_"): v for k, v in d.items() if k.startswith("peak_tflops_")},
            sustained_tflops={k.removeprefix("sustained_tflops_"): v for k, v in d.items()
                              if k.startswith("sustained_tflops_")},
            sustained_source=d.get("sustained_source", ""),
            framework_reserve_gib=mem["framework_reserve_gib"],
            allocator_headroom=mem["allocator_headroom"],
            **{k: d[k] for k in _DATASHEET},
            **{k: d[k] for k in _OPTIONAL if k in d},
            **e,
        )
    return out


DEVICE_PRESETS: dict[str, DeviceSpec] = _load_presets()
_ALIASES = {"A100": "A100-80GB", "H100": "H100-80GB", "H100-SXM": "H100-80GB", "A100-SXM-40GB": "A100-40GB",
            "A100-SXM-80GB": "A100-80GB", "H200-141GB": "H200", "V100": "V100-32GB", "RTX-2080-Ti": "RTX-2080Ti"}


_BY_LOWER = {k.lower(): k for k in DEVICE_PRESETS} | {a.lower(): k for a, k in _ALIASES.items()}


def device(name: str) -> DeviceSpec:
    """The preset ``name`` names, in any case and by its aliases; an unknown name is a one-line SpecError that
    suggests the nearest names (and ``local`` for this machine's CPUs).

    >>> device("h100").name, device("a100-sxm-40gb").name
    ('H100-80GB', 'A100-40GB')
    >>> device("H10")
    Traceback (most recent call last):
    ...
    flexmesh.errors.SpecError: unknown device 'H10' (did you mean H100, A10?); known: ...
    """
    key = _BY_LOWER.get(name.lower())
    if key is not None:
        return DEVICE_PRESETS[key]
    if name.lower() in ("cpu", "cpus", "local"):
        raise SpecError(f"device {name!r}: this machine's CPUs are `--cluster local` (or 2xlocal) of plan, simulate "
                        "and train, priced by its saved profile (`flexmesh profile hardware`); device presets are "
                        f"GPUs: {', '.join(DEVICE_PRESETS)}")
    near = difflib.get_close_matches(name.lower(), list(_BY_LOWER), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(dict.fromkeys(_display(n) for n in near))}?)" if near else ""
    raise SpecError(f"unknown device {name!r}{hint}; known: {', '.join(list(DEVICE_PRESETS) + list(_ALIASES))}")


def _display(lower: str) -> str:
    """The spelling a lower-cased preset or alias name is written with."""
    return next(n for n in list(DEVICE_PRESETS) + list(_ALIASES) if n.lower() == lower)


# Driver names (torch.cuda.get_device_name()) to presets: every listed word in the name, first match wins.
_DRIVER_NAMES = (
    (("GH200",), "GH200"), (("H200",), "H200"), (("B200",), "B200"), (("H100", "PCIE"), "H100-PCIe"),
    (("H100",), "H100-80GB"), (("A100", "PCIE", "40GB"), "A100-PCIe-40GB"), (("A100", "PCIE"), "A100-PCIe-80GB"),
    (("A100", "40GB"), "A100-40GB"), (("A100",), "A100-80GB"), (("V100", "16GB"), "V100-16GB"),
    (("V100",), "V100-32GB"), (("A10G",), "A10G"), (("A30",), "A30"), (("L40S",), "L40S"), (("L4",), "L4"),
    (("A10",), "A10"), (("A40",), "A40"), (("T4",), "T4"), (("TITAN RTX",), "TITAN-RTX"), (("2080 TI",), "RTX-2080Ti"),
    (("3090",), "RTX-3090"), (("4090",), "RTX-4090"),
)


def preset_of_gpu(gpu_name: str) -> str | None:
    """The device preset of a GPU as the driver names it (``torch.cuda.get_device_name()``), matched by
    family and memory; None for a GPU without a preset.

    >>> preset_of_gpu("NVIDIA H100 80GB HBM3"), preset_of_gpu("NVIDIA A100-SXM4-40GB"), preset_of_gpu("Tesla T4")
    ('H100-80GB', 'A100-40GB', 'T4')
    >>> preset_of_gpu("NVIDIA A100 80GB PCIe"), preset_of_gpu("NVIDIA GeForce RTX 4090"), preset_of_gpu("AMD MI300X")
    ('A100-PCIe-80GB', 'RTX-4090', None)
    """
    name = gpu_name.upper().replace("-", " ")
    words = name.replace("  ", " ")
    for needed, preset in _DRIVER_NAMES:
        if all(w.replace("-", " ") in words for w in needed):
            return preset
    return None
