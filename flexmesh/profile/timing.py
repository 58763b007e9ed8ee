"""What the cost model reads from profiles: a model profile's layer timing, a hardware profile's machine.

The only code that reads profile keys for pricing; :mod:`flexmesh.profile.use` builds a
:class:`~flexmesh.cost.CostModel` from these. Files and keys: docs/profiles.md; how the cost model
uses them: docs/cost-model.md.

:class:`ProfiledTiming` (a :class:`~flexmesh.cost.training.timing.LayerTiming`), from ``flexmesh profile model``:

- a layer's forward and backward seconds are the profile's fits ``c0 + (c1 * tokens +
  c2 * sum(len^2) + c3 * tokens^2) / (tp * cp)`` (backward under recomputation has its own fit);
  the embedding's and the head's likewise, linear in tokens. Where the profile timed the layer
  under real process groups of the strategy's (tp, cp kind, cp) -- or the ends under its tp --
  those fits are used instead, and the TP / CP communication they include is not added again;
- activation bytes per token come from the profile's table for the strategy's (tp, cp,
  recompute: none, selective or full); a degree pair it did not measure falls back to the tp = cp = 1
  value divided by tp * cp. Selective recomputation's backward is the backward fit plus the
  forward fit's quadratic (attention) part, which runs again. The dense attention mask the CPU
  kernel saves (``attention_mask_bytes_per_sq_row_token`` x tokens^2 per layer, local and Ulysses
  attention; ring attention and a selectively recomputed core save none) is the mask term;
- every pass's time (layers and ends, measured in one process or under real groups) is multiplied
  by the profile's whole-model factor for its direction (``whole_model``: the model timed as the trainer
  runs it, fitted as ``factor x parts + fixed``; 1 for profiles without one), so that a micro-batch
  costs what the layers cost in sequence rather than each alone with its data in cache, and each
  micro-batch pays the fixed seconds (0 without them) once, with the head;
- under pipelining, every chunk pays the profile's framework seconds per micro-batch
  (``pipeline.stage_fixed_s``: the runtime's schedule with the model cut into more stages, less the
  same model in fewer; 0 for profiles without it) beside its sends and receives;
- weights, gradients and optimizer states take the profile's bytes per parameter, the optimizer
  step its seconds per parameter, and every byte count the profile's dtype.

:class:`ProfiledHardware` (a :class:`~flexmesh.cost.Hardware`), from ``flexmesh profile hardware``:
every number comes from a measurement: matmul and attention throughput, memory bandwidth, and per
(collective, group size, intra/inter node) the measured times by message size (:func:`measured_curve`:
made non-decreasing, interpolated log-log as the presets' NCCL tables are), or, for a collective
the profile kept no samples of, its fitted ``alpha + beta * bytes``. A group size the profile did not
measure takes the nearest measured size of the same scope (else of the other scope) and scales it by
the algorithm's volume: ring collectives move ``(n - 1) / n`` of the buffer (twice for all-reduce) in
``n - 1`` steps and all-to-all sends ``(n - 1) / n`` of it to ``n - 1`` peers, so the curve (or beta)
scales by ``((n - 1) / n) / ((m - 1) / m)`` and a fit's alpha by ``(n - 1) / (m - 1)`` from measured
size ``m``; send/recv does not depend on the group.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from scipy.optimize import isotonic_regression

from flexmesh.cost.device.hardware import COLLECTIVES, PRESET_OVERLAP, CommTable, GroupShape, Hardware
from flexmesh.cost.training.timing import LayerTimes
from flexmesh.cost.training.work import Amount
from flexmesh.errors import ProfileError
from flexmesh.layout.stack import RUNTIME_STACK
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.profile.format import CollectiveFit, HardwareProfile, ModelProfile
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import DTYPE_BYTES, ModelSpec


class ProfiledTiming:
    """:class:`~flexmesh.cost.training.timing.LayerTiming` from a model profile (see the module doc).

    >>> from flexmesh.cost import CostModel
    >>> from flexmesh.profile.fit import LayerFit
    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> fit = LayerFit(1e-3, 1e-6, 0.0)
    >>> mp = ModelProfile(model=MODEL_PRESETS["tiny"].to_dict(), dtype="fp32",
    ...                   layer={"forward": fit, "backward": fit, "backward_recompute": fit},
    ...                   embedding={"forward": fit, "backward": fit}, head={"forward": fit, "backward": fit},
    ...                   activations={"layers": [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 100.0}],
    ...                                "attention_mask_bytes_per_sq_row_token": 0.0,
    ...                                "embedding_bytes_per_token": 4.0, "head_bytes_per_token": 8.0},
    ...                   states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4,
    ...                           "optimizer_bytes_per_param": 8, "optimizer_step_s_per_param": 1e-9}, name="tiny.json")
    >>> cm = CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), timing=ProfiledTiming(mp))
    >>> cm.source, cm.model.dtype
    ('preset:A100-80GB+profile:tiny.json', 'fp32')
    >>> cm.activation_bytes_per_token(LayerStrategy(tp=2), layers=1)  # not measured at tp 2: tp 1 / 2
    50.0
    """

    # A profile times flexmesh's own runtime, so it prices that stack's layers and no other's.
    stack = RUNTIME_STACK

    def __init__(self, profile: ModelProfile):
        self.profile = profile
        self.dtype = profile.dtype  # the dtype the profile measured (the runtime's)
        self.k_fwd, self.k_bwd = profile.whole_factor("forward"), profile.whole_factor("backward")
        self.fixed_fwd, self.fixed_bwd = profile.whole_fixed("forward"), profile.whole_fixed("backward")

    def check_model(self, model: ModelSpec) -> None:
        """Raise ProfileError unless the profile measured a model of ``model``'s shape."""
        self.profile.check_model(model)

    def source(self, hardware_source: str) -> str:
        """The hardware's source and this profile's name: ``profile:hw.json+m.json``,
        ``preset:A100-80GB+profile:m.json``."""
        sep = "+" if hardware_source.startswith("profile:") else "+profile:"
        return f"{hardware_source}{sep}{self.profile.name}"

    def layer_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        """The fits timed under real tp x cp groups where profiled (communication included), else
        the one-process fits with their token-dependent part split over tp x cp."""
        split = s.tp * s.cp
        backward = "backward_recompute" if s.recompute else "backward"
        # Selective recomputation runs the forward's attention (the fit's quadratic part) again.
        selective = s.recompute is Recompute.SELECTIVE
        kf, kb = self.k_fwd, self.k_bwd
        measured = self.profile.parallel_layer(s.tp, s.cp_kind, s.cp) if split > 1 else None
        if measured is not None:
            again = measured["forward"].attention(tokens, sq_tokens) if selective else 0.0
            return LayerTimes(fwd=kf * measured["forward"].time(tokens, sq_tokens),
                              bwd=kb * (measured[backward].time(tokens, sq_tokens) + again),
                              includes_communication=True)
        fit = self.profile.layer
        attention = fit["forward"].attention(tokens, sq_tokens, split)
        return LayerTimes(fwd=kf * fit["forward"].time(tokens, sq_tokens, split),
                          bwd=kb * (fit[backward].time(tokens, sq_tokens, split) + (attention if selective else 0.0)),
                          attention=kf * attention)

    def embedding_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) of the embedding's fits; see :meth:`_end_time`."""
        return self._end_time("embedding_forward", s, tokens), self._end_time("embedding_backward", s, tokens)

    def head_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) of the final norm + LM head + loss fits (see :meth:`_end_time`), plus the
        whole model's fixed seconds per micro-batch (charged once per micro-batch that has tokens, with
        the head: on a pipeline's last stage)."""
        ran = np.asarray(tokens, dtype=float) > 0
        fwd = self._end_time("head_forward", s, tokens) + np.where(ran, self.fixed_fwd, 0.0)
        bwd = self._end_time("head_backward", s, tokens) + np.where(ran, self.fixed_bwd, 0.0)
        return (float(fwd), float(bwd)) if np.ndim(fwd) == 0 else (fwd, bwd)

    def _end_time(self, key: str, s: LayerStrategy, tokens: Amount) -> Amount:
        """Seconds of ``key`` (``embedding_forward``, ..., ``head_backward``) for ``tokens`` on a
        tp x cp group: timed under a real tp group where profiled, else the one-process fit split."""
        part, direction = key.split("_")
        k = self.k_fwd if direction == "forward" else self.k_bwd
        measured = self.profile.parallel_ends(s.tp) if s.tp > 1 else None
        if measured is not None:  # each cp rank runs the ends on its own tokens
            return k * measured[key].time(np.asarray(tokens, dtype=float) / s.cp, 0.0)
        return k * getattr(self.profile, part)[direction].time(tokens, 0.0, s.tp * s.cp)

    def activation_bytes_per_token(self, s: LayerStrategy, recompute: bool) -> float:
        """The table's bytes per token for (tp, cp, recompute); unmeasured: tp = cp = 1 / (tp * cp).

        Under selective recomputation (``recompute`` False, ``s.recompute`` selective) the table's
        ``selective`` entry; a profile without one (made before selective existed) gives the bytes
        without recomputation, an upper bound."""
        mode: bool | str = recompute
        if not recompute and s.recompute is Recompute.SELECTIVE:
            mode = "selective" if self.profile.activation_entry(1, 1, "selective") is not None else False
        entry = self.profile.activation_entry(s.tp, s.cp, mode)
        if entry is not None:
            return float(entry["bytes_per_token"])
        base = self.profile.activation_entry(1, 1, mode)
        if base is None:
            raise ProfileError(f"model profile {self.profile.name} has no tp=1 cp=1 activation measurement "
                               f"(recompute={recompute}); re-run `flexmesh profile model`")
        return float(base["bytes_per_token"]) / (s.tp * s.cp)

    def activation_bytes(self, s: LayerStrategy, tokens: float, recompute: bool) -> float:
        """:meth:`activation_bytes_per_token` x ``tokens``."""
        return self.activation_bytes_per_token(s, recompute) * tokens

    def mask_bytes(self, s: LayerStrategy, tokens: float, sq_tokens: float = 0.0) -> float:
        """``attention_mask_bytes_per_sq_row_token`` x tokens^2; the ring kernel keeps no mask, nor
        does a selectively recomputed attention core (the mask is made again in backward)."""
        if (s.cp > 1 and s.cp_kind == "ring") or s.recompute is Recompute.SELECTIVE:
            return 0.0
        return float(self.profile.activations["attention_mask_bytes_per_sq_row_token"]) * tokens * tokens

    def carried_bytes(self, s: LayerStrategy, prefix: float, tokens: float) -> float:
        """The profile's fit of what a carried piece keeps beyond the same tokens whole (one device;
        shards divide it by tp x cp), or the analytic prefix keys and values where the profile
        predates the measurement."""
        fit = self.profile.activations.get("carried")
        if fit is None:
            m = self.profile.model
            head_dim = m.get("head_dim_override") or m["hidden"] // m["num_heads"]
            return 2.0 * m["num_kv_heads"] * head_dim * prefix * DTYPE_BYTES[self.dtype] / (s.tp * s.cp)
        p, n = float(prefix), float(tokens)
        total = (fit["per_prefix_token"] * p + fit["per_prefix_query_pair"] * p * n + fit["per_query_sq"] * n * n
                 + fit["per_query"] * n)
        return float(total) / (s.tp * s.cp)

    def embedding_activation_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """``embedding_bytes_per_token`` x each cp rank's tokens."""
        return tokens / s.cp * float(self.profile.activations["embedding_bytes_per_token"])

    def logit_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """``head_bytes_per_token`` x each cp rank's tokens: the runtime's tp head gathers the logits
        on every tp rank, so the measurement divides by cp only."""
        return tokens / s.cp * float(self.profile.activations["head_bytes_per_token"])

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """The measured weight, gradient and optimizer-state bytes per parameter."""
        st = self.profile.states
        return (float(st["weight_bytes_per_param"]), float(st["grad_bytes_per_param"]),
                float(st["optimizer_bytes_per_param"]))

    def optimizer_s_per_param(self) -> float:
        """The measured optimizer step seconds per parameter."""
        return float(self.profile.states["optimizer_step_s_per_param"])

    def stage_fixed_s(self) -> float:
        """The measured framework seconds per pipeline chunk per micro-batch (0 for older profiles)."""
        return self.profile.stage_fixed()


class ProfiledHardware(Hardware):
    """:class:`~flexmesh.cost.Hardware` whose numbers come from a hardware profile (see the module doc).

    ``dtype`` picks the matmul and attention throughput. Memory per device is the profile's (on CPU:
    the RAM divided among the cluster's devices per node, the processes that will share it).

    >>> from flexmesh.profile.format import CollectiveFit
    >>> from flexmesh.spec.cluster import device
    >>> hw = HardwareProfile(device={"type": "cpu", "name": "cpu", "nodes": 1, "devices_per_node": 2,
    ...                              "memory_bytes": 2**33}, dtype="fp32", matmul_flops_per_s={"fp32": 5e10},
    ...                      memory_bytes_per_s=1e10, attention={"fp32": {"flops_per_s": 2e10}},
    ...                      collectives=[CollectiveFit("all_gather", 2, "intra", 1e-4, 1e-9)])
    >>> h = ProfiledHardware(ClusterSpec(1, 4, device("A100-80GB")), hw, hw.dtype)
    >>> h.collective_time("all_gather", 1e6, GroupShape(2, 4))  # measured: 1e-4 + 1e-9 * 1e6
    0.0011
    >>> round(h.collective_time("all_gather", 1e6, GroupShape(4, 4)), 6)  # 3/4 vs 1/2 volume, 3 vs 1 steps
    0.0018
    """

    def __init__(self, cluster: ClusterSpec, profile: HardwareProfile, dtype: str):
        self.cluster = cluster
        self.dtype = dtype
        self.profile = profile
        self.matmul_flops = profile.matmul(dtype)
        self.peak_flops = self.matmul_flops  # measured, so MFU is against what this machine reaches
        self.clock = 1.0  # measured rates: the clock the machine sustains is in them
        self.attn_flops = profile.attention_flops(dtype)
        self.hbm_bytes_per_s = float(profile.memory_bytes_per_s)
        self.memory_bytes = profile.memory_per_device(cluster.devices_per_node)
        self.source = f"profile:{profile.name}"
        # measured by the hardware profiler where it ran more than one process; else the preset's rule
        self.overlap = float(profile.overlap["hidden_fraction"]) if profile.overlap else PRESET_OVERLAP
        self._fits = {(c.collective, c.group_size, c.scope): c for c in reversed(profile.collectives)}
        self._curves = {key: measured_curve(f) for key, f in self._fits.items() if len(f.samples) >= 2}

    def copy_time(self, nbytes: float) -> float:
        """Seconds of a copy moving ``nbytes`` at the measured memory bandwidth."""
        return nbytes / self.hbm_bytes_per_s if nbytes > 0 else 0.0

    def additive(self) -> ProfiledHardware:
        """A copy whose measured curves run at their best bandwidth with no latency (see
        :meth:`flexmesh.cost.Hardware.additive`); collectives with only a fit keep it."""
        other = copy.copy(self)
        other._curves = {key: curve.envelope() for key, curve in self._curves.items()}
        return other

    def describe(self) -> str:
        """One line for ``plan --explain``: what was measured and how collectives are priced."""
        fitted = len(self._fits) - len(self._curves)
        return (f"device measured by `flexmesh profile hardware` ({self.profile.name}): matmul "
                f"{self.matmul_flops / 1e12:.3g} TFLOP/s, attention {self.attn_flops / 1e12:.3g} TFLOP/s, memory "
                f"{self.hbm_bytes_per_s / 1e9:.3g} GB/s; collectives at their measured times by message size "
                f"({len(self._curves)} curves" + (f", {fitted} alpha-beta fits without samples" if fitted else "")
                + f"), overlap saves {self.overlap:.2f} of hidden communication")

    def _nearest(self, kind: str, n: int, scope: str) -> tuple[str, int, str]:
        """The measured (kind, group size, scope) that prices ``kind`` over ``n`` ranks: that one, else the
        nearest size of the same scope, else of the other."""
        if (kind, n, scope) in self._fits:
            return kind, n, scope
        sizes = [(abs(math.log2(s) - math.log2(n)), sc != scope, s, sc) for (k, s, sc) in self._fits if k == kind]
        if not sizes:
            raise ProfileError(
                f"hardware profile {self.profile.name} has no {kind} measurement; it was profiled with one process? "
                f"re-run `flexmesh profile hardware --nproc N` with N >= 2")
        _, _, m, sc = min(sizes, key=lambda x: (x[1], x[0], -x[2]))
        return kind, m, sc

    def collective_time(self, kind: str, nbytes, shape: GroupShape):
        """Seconds for one collective: the profile's measured times by message size where it kept them, else
        its alpha-beta fit; ``nbytes`` as in :class:`Hardware`."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
        if shape.size <= 1:
            return np.zeros_like(nbytes, dtype=float) if isinstance(nbytes, np.ndarray) else 0.0
        n = 2 if kind == "send_recv" else shape.size
        key = self._nearest(kind, n, "intra" if shape.intra_node else "inter")
        m = key[1]
        volume = 1.0 if m == n else ((n - 1) / n) / ((m - 1) / m)
        curve = self._curves.get(key)
        if curve is not None:
            return curve.time(kind, m, nbytes) * volume
        f = self._fits[key]
        return f.alpha_s * (n - 1) / (m - 1) + f.beta_s_per_byte * volume * nbytes


def measured_curve(fit: CollectiveFit) -> CommTable:
    """A profiled collective's samples as a :class:`~flexmesh.cost.device.hardware.CommTable` (log-log
    interpolation by message size, the latency floor below the smallest, the largest's bandwidth above).
    The times are first made non-decreasing in bytes by isotonic regression (SciPy's pool-adjacent-
    violators): a larger message never takes less time, and a noisy sample does not make one.

    >>> c = measured_curve(CollectiveFit("all_gather", 2, "intra", 0.0, 0.0,
    ...                                  ((1e3, 2e-5), (1e4, 1e-5), (1e6, 1e-4))))
    >>> [round(float(c.time("all_gather", 2, b)) * 1e6, 1) for b in (1e3, 1e4, 1e6, 2e6)]
    [15.0, 15.0, 100.0, 200.0]
    """
    pairs = sorted((float(b), float(t)) for b, t in fit.samples if b > 0)
    times = np.maximum(isotonic_regression([t for _, t in pairs]).x, 1e-9)
    return CommTable({fit.collective: {fit.group_size: (tuple(b for b, _ in pairs), tuple(float(t) for t in times))}})
