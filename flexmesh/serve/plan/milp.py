"""The deployment MILP: how many replicas of each configuration, and which share of each bucket goes where.

The formulation of "Demystifying cost-efficiency in LLM serving over heterogeneous GPUs" (2502.00722: GPU
mix, deployment configurations and workload assignment under budget and availability) with
prefill/decode disaggregation bounded by the links between device groups (HexGen-2's pairing), solved by
HiGHS through :func:`scipy.optimize.milp`. Columns are configurations ``c`` (a model, a device group, its
devices, a role); rows are buckets ``b``. Variables:

- ``n[c]``: replicas of ``c`` (whole numbers);
- ``x[c, b]``: requests per second of bucket ``b`` entering at ``c`` (an aggregated or a prefill replica);
- ``y[c, b]``: requests per second of bucket ``b`` decoded at a decode replica ``c``;
- ``f[m, b, g, h]``: requests per second of model ``m``'s bucket ``b`` prefilled on group ``g`` and decoded on
  group ``h`` (their KV moved over the link between them);
- ``rate``: the request rate served (maximised), or given (the cost is minimised).

Constraints: every bucket's demand ``demand[m, b] x rate`` enters somewhere; a replica is busy at most all the
time (``sum_b x[c, b] / capacity[c, b] <= n[c]``, the same for decodes); a prefill group's requests of a bucket
(that decodes at all) flow to decode groups and every decode group decodes what flows in; the KV bytes a
second over each link between two groups stay within it; devices per group within what is available; the
price within the budget.

Partial buckets (``misses``, the fast re-plan's): up to that share of the rate may enter where it misses the
SLO (variables ``w[c, b]``, priced at ``capacity_any[c, b]``, each replica's rate with no latency bound: the
requests still take its time), so that surviving replicas that serve a bucket within the SLO only slowly, or not
at all, need not hold the whole rate down to it; without ``misses`` every request enters within the SLO.

Mélange's bucket ILP (2404.14527) is the special case without prefill/decode: aggregated columns only, a given
rate, each bucket cut in ``slices`` equal slices each sent whole to one configuration (``slices``), the cost
minimised.

>>> import numpy as np
>>> cols = Columns(model=[0, 0], group=[0, 1], devices=[1, 1], role=["aggregated", "aggregated"])
>>> # Mélange's published example (melange-release, melange/main.py): A10G $1.01/h, A100 $3.67/h, 16 req/s
>>> tputs = np.array([[5, 1, 10, 5], [20, 2, 50, 20]], dtype=float)  # per bucket, requests/s per GPU
>>> problem = Problem(cols, tputs, demand=np.array([[0.25, 0.125, 0.375, 0.25]]), available=[10**6, 10**6],
...                   price=[1.01, 3.67], rate=16.0, slices=1)
>>> s = solve(problem)
>>> s.counts.tolist(), round(s.cost, 2)
([5, 0], 5.05)
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from flexmesh.console import quietly
from flexmesh.errors import PlanError
from flexmesh.serve.layout.roles import Role

# HiGHS's relative MIP gap: a plan within 2% of the best the model allows (the analytic capacities are not
# that exact; the simulator judges the plans).
MIP_GAP = 2e-2
# Seconds HiGHS may take per solve: a safety net (plans are meant not to depend on it).
TIME_LIMIT_S = 20.0
# The quick solve runs the whole MILP (beside the one over the relaxation's configurations) up to this many
# configurations: beyond, HiGHS takes seconds to close the gap the relaxation leaves, for a percent or two.
WHOLE_MILP_COLUMNS = 24
# The second solve (the first plan's idle replicas trimmed) keeps this share of the rate found first.
RATE_KEPT = 1 - 1e-4


@dataclass(frozen=True)
class Columns:
    """What the MILP needs of each configuration: its model (tier), device group, devices, role, and the shape
    of its weights (replicas of one shape may change role without moving them: the fast re-plan)."""

    model: Sequence[int]
    group: Sequence[int]
    devices: Sequence[int]
    role: Sequence[str]
    shape: Sequence[Hashable] = ()

    def __post_init__(self) -> None:
        n = len(self.model)
        if not (len(self.group) == len(self.devices) == len(self.role) == n) or (self.shape and len(self.shape) != n):
            raise PlanError("configuration columns of unequal lengths")

    def __len__(self) -> int:
        return len(self.model)


@dataclass(frozen=True)
class Problem:
    """One MILP: ``capacity[c, b]`` requests/s one replica of ``c`` serves of bucket ``b`` (0: it cannot);
    ``demand[m, b]`` model ``m``'s bucket ``b`` as a share of the rate; per device group the devices
    ``available`` and the ``price`` per device-hour; ``kv_bytes[m, b]`` what one request's hand-off moves and
    ``link_bytes_per_s[g, h]`` the link between groups; ``decodes[m, b]`` whether the bucket decodes at all
    (more than one output token). ``rate`` given: the cheapest plan serving it; else the highest rate within
    ``budget``. ``limits``: at most this many replicas of each weights shape (the others: none); ``counts``:
    exactly these replicas of each configuration (what is left is the routing, a linear program)."""

    columns: Columns
    capacity: np.ndarray
    demand: np.ndarray
    available: Sequence[int]
    price: Sequence[float]
    budget: float | None = None
    rate: float | None = None
    kv_bytes: np.ndarray | None = None
    link_bytes_per_s: np.ndarray | None = None
    decodes: np.ndarray | None = None
    slices: int | None = None
    limits: dict[Hashable, int] | None = None
    counts: Sequence[int] | None = None
    time_limit_s: float = TIME_LIMIT_S
    relaxed: bool = False  # the linear relaxation (replica counts fractional): a bound on the best plan
    misses: float = 0.0  # the share of the rate that may enter missing the SLO (partial buckets)
    capacity_any: np.ndarray | None = None  # [c, b] requests/s one replica serves with no latency bound


@dataclass(frozen=True)
class Solution:
    """A solved MILP: ``counts[c]`` replicas; ``entry[c, b]`` and ``decode[c, b]`` requests/s routed; ``flows``
    ``{(model, bucket, g, h): requests/s}`` handed from prefill group ``g`` to decode group ``h``; the rate and
    the price ($/h)."""

    rate: float
    counts: np.ndarray
    entry: np.ndarray
    decode: np.ndarray
    flows: dict[tuple[int, int, int, int], float]
    cost: float
    seconds: float
    notes: tuple[str, ...] = field(default=())
    bound: float | None = None  # the linear relaxation's rate (or, at a given rate, its cost): no plan does better
    missed: np.ndarray | None = None  # [c, b] of ``entry``: requests/s entering that miss the SLO (partial buckets)

    @property
    def gap(self) -> float | None:
        """How far from the relaxation's bound (a fraction; 0 is proven best)."""
        if self.bound is None or self.bound <= 0:
            return None
        return abs(self.bound - (self.cost if self.rate_given else self.rate)) / self.bound

    rate_given: bool = False

    def load(self, capacity: np.ndarray) -> np.ndarray:
        """Per configuration, the share of its replicas' time the routed requests take (<= 1 each)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            busy = np.where(capacity > 0, (self.entry + self.decode) / np.where(capacity > 0, capacity, 1), 0)
        return np.where(self.counts > 0, busy.sum(axis=1) / np.maximum(self.counts, 1), 0.0)


class _Vars:
    """Variable indices and bounds, built in order."""

    def __init__(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []

    def add(self, lo: float, hi: float, integer: bool = False) -> int:
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(1 if integer else 0)
        return len(self.lo) - 1


class _Rows:
    """Sparse constraint rows ``lb <= a x <= ub``."""

    def __init__(self) -> None:
        self.data: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, terms: dict[int, float], lb: float, ub: float) -> None:
        r = len(self.lb)
        for col, coef in terms.items():
            if coef != 0:
                self.rows.append(r)
                self.cols.append(col)
                self.data.append(coef)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, nvars: int) -> LinearConstraint:
        a = sp.csr_array((self.data, (self.rows, self.cols)), shape=(len(self.lb), nvars))
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


def solve(problem: Problem) -> Solution:
    """The best plan of ``problem`` (PlanError in one line when none exists)."""
    t0 = time.perf_counter()
    f = _Formulation(problem)
    f.demand_rows()
    f.capacity_rows()
    f.handoff_rows()
    f.link_rows()
    f.partial_rows()
    f.device_rows()
    f.budget_rows()
    return f.solve(t0)


class _Formulation:
    """The MILP of one problem (the module doc): its variables made in order (the rate, replica counts, routes,
    partial routes, prefill-to-decode flows), then its rows family by family, then HiGHS."""

    def __init__(self, problem: Problem):
        p = self.p = problem
        cols = self.cols = p.columns
        nc = self.nc = len(cols)
        self.cap = np.asarray(p.capacity, dtype=float)
        self.demand = np.atleast_2d(np.asarray(p.demand, dtype=float))
        self.nm, self.nb = self.demand.shape
        if self.cap.shape != (nc, self.nb):
            raise PlanError(f"capacity is {self.cap.shape}, expected {(nc, self.nb)} (configurations x buckets)")
        self.decodes = np.ones((self.nm, self.nb), bool) if p.decodes is None else np.asarray(p.decodes, bool)
        if p.rate is None and p.budget is None and not p.limits and p.counts is None:
            raise PlanError("give a rate to serve at the least cost, or a budget to serve the most within")
        if p.slices is not None and (p.rate is None or p.slices < 1):
            raise PlanError("slices (Mélange's whole slices of a bucket) need a given rate and at least one slice")
        self.price = [float(x) for x in p.price]
        self.v, self.rows = _Vars(), _Rows()
        self.fixed_rate = p.rate is not None
        self.rate_var = -1 if self.fixed_rate else self.v.add(0.0, math.inf)
        self.rate = float(p.rate) if p.rate is not None else 0.0
        self.notes: list[str] = []
        self._replicas()
        self._routes()
        self._misses()
        self._flows()

    # ---- variables -----------------------------------------------------------------------------------
    def _replicas(self) -> None:
        """``n[c]``: replicas of each configuration, within what its group has (and ``limits``, ``counts``)."""
        p, cols, nc = self.p, self.cols, self.nc
        self.allowed = [True] * nc
        if p.limits is not None:
            if not cols.shape:
                raise PlanError("limits by weights shape need the columns' shapes")
            self.allowed = [cols.shape[c] in p.limits for c in range(nc)]
        self.n_var = []
        for c in range(nc):
            most = p.available[cols.group[c]] // cols.devices[c] if self.allowed[c] else 0
            if p.limits is not None and self.allowed[c]:
                most = min(most, p.limits[cols.shape[c]])
            least = 0
            if p.counts is not None:
                least = most = int(p.counts[c])
                self.allowed[c] = most > 0
            self.n_var.append(self.v.add(float(least), float(most), integer=True))

    def _routes(self) -> None:
        """``x[c, b]`` entering at an aggregated or prefill configuration (whole slices with ``slices``), ``y[c, b]``
        decoded at a decode one."""
        p, cols, v = self.p, self.cols, self.v
        self.entry: dict[tuple[int, int], tuple[int, float]] = {}  # (c, b) -> (variable, requests/s per unit)
        self.dec: dict[tuple[int, int], int] = {}
        self.entry_of: dict[int, list[tuple[int, int, float]]] = {}  # c -> [(b, variable, unit)]
        self.entry_in: dict[tuple[int, int], list[tuple[int, int, float]]] = {}  # (m, b) -> [(c, variable, unit)]
        self.dec_of: dict[int, list[tuple[int, int]]] = {}
        self.dec_in: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for c in range(self.nc):
            m, role = cols.model[c], cols.role[c]
            if not self.allowed[c]:
                continue
            for b in range(self.nb):
                if self.cap[c, b] <= 0 or self.demand[m, b] <= 0:
                    continue
                if role == Role.DECODE:
                    if self.decodes[m, b]:
                        var = self.dec[c, b] = v.add(0.0, math.inf)
                        self.dec_of.setdefault(c, []).append((b, var))
                        self.dec_in.setdefault((m, b), []).append((c, var))
                    continue
                if p.slices is not None:
                    var, unit = v.add(0.0, float(p.slices), integer=True), self.demand[m, b] * self.rate / p.slices
                else:
                    var, unit = v.add(0.0, math.inf), 1.0
                self.entry[c, b] = (var, unit)
                self.entry_of.setdefault(c, []).append((b, var, unit))
                self.entry_in.setdefault((m, b), []).append((c, var, unit))

    def _misses(self) -> None:
        """``w[c, b]``: requests/s entering that miss the SLO (partial buckets), priced with no latency bound."""
        p, cols = self.p, self.cols
        self.miss: dict[tuple[int, int], int] = {}
        self.miss_of: dict[int, list[tuple[int, int, float]]] = {}  # c -> [(b, variable, capacity without SLO)]
        if p.misses > 0:
            if p.capacity_any is None or p.slices is not None:
                raise PlanError("partial buckets (misses) need each configuration's capacity without the SLO, and "
                                "no slices")
            any_cap = np.asarray(p.capacity_any, dtype=float)
            for c in range(self.nc):
                if not self.allowed[c] or cols.role[c] == Role.DECODE:
                    continue
                for b in range(self.nb):
                    if any_cap[c, b] > 0 and self.demand[cols.model[c], b] > 0:
                        self.miss[c, b] = self.v.add(0.0, math.inf)
                        self.miss_of.setdefault(c, []).append((b, self.miss[c, b], float(any_cap[c, b])))
        self.miss_in: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for (c, b), var in self.miss.items():
            self.miss_in.setdefault((cols.model[c], b), []).append((c, var))

    def _flows(self) -> None:
        """``f[m, b, g, h]``: hand-offs from prefill group ``g`` to decode group ``h``, for the models whose
        prefill groups could send more KV than a link carries (elsewhere each bucket's prefills and decodes
        balance as a whole: fewer variables, the same plans)."""
        p, cols, cap, nc = self.p, self.cols, self.cap, self.nc
        prefill_groups: dict[int, list[int]] = {}
        decode_groups: dict[int, list[int]] = {}
        for c in range(nc):
            if not self.allowed[c]:
                continue
            if cols.role[c] == Role.PREFILL:
                prefill_groups.setdefault(cols.model[c], []).append(cols.group[c])
            elif cols.role[c] == Role.DECODE:
                decode_groups.setdefault(cols.model[c], []).append(cols.group[c])
        self.pre_g = {m: sorted(set(gs)) for m, gs in prefill_groups.items()}
        self.dec_g = {m: sorted(set(gs)) for m, gs in decode_groups.items()}
        self.link = None if p.link_bytes_per_s is None else np.asarray(p.link_bytes_per_s, dtype=float) / 1e9
        self.kv = None if p.kv_bytes is None else np.asarray(p.kv_bytes, dtype=float) / 1e9
        self.paired: set[int] = set()
        if self.link is not None and self.kv is not None:
            for m in range(self.nm):
                for g in self.pre_g.get(m, ()):
                    most = sum(cap[c, b] * (p.available[g] // cols.devices[c]) * self.kv[m, b] for c in range(nc)
                               if self.allowed[c] and cols.model[c] == m and cols.role[c] == Role.PREFILL
                               and cols.group[c] == g for b in range(self.nb) if self.decodes[m, b])
                    if any(h != g and most > self.link[g, h] for h in self.dec_g.get(m, ())):
                        self.paired.add(m)
        self.flow: dict[tuple[int, int, int, int], int] = {}
        for m in sorted(self.paired):
            for b in range(self.nb):
                if self.demand[m, b] <= 0 or not self.decodes[m, b]:
                    continue
                for g in self.pre_g.get(m, ()):
                    for h in self.dec_g.get(m, ()):
                        self.flow[m, b, g, h] = self.v.add(0.0, math.inf)

    # ---- rows ------------------------------------------------------------------------------------------
    def demand_rows(self) -> None:
        """Each bucket of each model enters somewhere."""
        p, rows = self.p, self.rows
        for m in range(self.nm):
            for b in range(self.nb):
                if self.demand[m, b] <= 0:
                    continue
                terms = {var: unit for _, var, unit in self.entry_in.get((m, b), ())}
                terms.update({var: 1.0 for _, var in self.miss_in.get((m, b), ())})
                if not terms:
                    raise PlanError(f"no configuration serves bucket {b} of model {m} within the SLO; relax the SLO, "
                                    "give faster or larger devices, or drop those requests")
                if p.slices is not None:
                    rows.add({var: 1.0 for var in terms}, float(p.slices), float(p.slices))
                elif self.fixed_rate:
                    rows.add(terms, self.demand[m, b] * self.rate, self.demand[m, b] * self.rate)
                else:
                    rows.add({**terms, self.rate_var: -self.demand[m, b]}, 0.0, 0.0)

    def capacity_rows(self) -> None:
        """Each configuration's replicas busy at most all the time."""
        cap = self.cap
        for c in range(self.nc):
            terms = {var: unit / cap[c, b] for b, var, unit in self.entry_of.get(c, ())}
            terms.update({var: 1.0 / cap[c, b] for b, var in self.dec_of.get(c, ())})
            terms.update({var: 1.0 / most for _, var, most in self.miss_of.get(c, ())})
            if terms:
                self.rows.add({**terms, self.n_var[c]: -1.0}, -math.inf, 0.0)

    def handoff_rows(self) -> None:
        """Prefill -> decode: what a group prefills of a decoding bucket flows out, what a group decodes flows in."""
        cols, rows = self.cols, self.rows
        for m in range(self.nm):
            for b in range(self.nb):
                if self.demand[m, b] <= 0 or not self.decodes[m, b] or not self.pre_g.get(m):
                    continue
                entry_in, miss_in, dec_in = (self.entry_in.get((m, b), ()), self.miss_in.get((m, b), ()),
                                             self.dec_in.get((m, b), ()))
                if m not in self.paired:
                    terms = {var: unit for c, var, unit in entry_in if cols.role[c] == Role.PREFILL}
                    terms.update({var: 1.0 for c, var in miss_in if cols.role[c] == Role.PREFILL})
                    terms.update({var: -1.0 for _, var in dec_in})
                    rows.add(terms, 0.0, 0.0)
                    continue
                for g in self.pre_g.get(m, ()):
                    terms = {var: unit for c, var, unit in entry_in
                             if cols.role[c] == Role.PREFILL and cols.group[c] == g}
                    terms.update({var: 1.0 for c, var in miss_in
                                  if cols.role[c] == Role.PREFILL and cols.group[c] == g})
                    terms.update({self.flow[m, b, g, h]: -1.0 for h in self.dec_g.get(m, ())})
                    rows.add(terms, 0.0, 0.0)
                for h in self.dec_g.get(m, ()):
                    terms = {var: 1.0 for c, var in dec_in if cols.group[c] == h}
                    terms.update({self.flow[m, b, g, h]: -1.0 for g in self.pre_g.get(m, ())})
                    rows.add(terms, 0.0, 0.0)

    def link_rows(self) -> None:
        """KV bytes a second between two groups (in GB: HiGHS wants coefficients near 1)."""
        if not self.flow:
            return
        assert self.link is not None and self.kv is not None
        over: dict[tuple[int, int], dict[int, float]] = {}
        for (m, b, g, h), var in self.flow.items():
            if g != h and math.isfinite(self.link[g, h]):
                over.setdefault((g, h), {})[var] = self.kv[m, b]
        for (g, h), terms in sorted(over.items()):
            self.rows.add(terms, -math.inf, float(self.link[g, h]))

    def partial_rows(self) -> None:
        """What enters missing the SLO within its share of the rate (partial buckets)."""
        if not self.miss:
            return
        misses = {var: 1.0 for var in self.miss.values()}
        if self.fixed_rate:
            self.rows.add(misses, -math.inf, self.p.misses * self.rate)
        else:
            self.rows.add({**misses, self.rate_var: -self.p.misses}, -math.inf, 0.0)

    def device_rows(self) -> None:
        """Devices available per group."""
        cols = self.cols
        for g in range(len(self.p.available)):
            terms = {self.n_var[c]: float(cols.devices[c]) for c in range(self.nc) if cols.group[c] == g
                     and self.allowed[c]}
            if terms:
                self.rows.add(terms, -math.inf, float(self.p.available[g]))

    def budget_rows(self) -> None:
        """The price within the budget; at most ``limits`` replicas of each weights shape."""
        p, cols = self.p, self.cols
        self.cost_terms = {self.n_var[c]: self.price[cols.group[c]] * cols.devices[c] for c in range(self.nc)
                           if self.allowed[c]}
        if p.budget is not None:
            self.rows.add(self.cost_terms, -math.inf, float(p.budget))
        if p.limits is not None:
            for shape, most in p.limits.items():
                self.rows.add({self.n_var[c]: 1.0 for c in range(self.nc) if self.allowed[c]
                               and cols.shape[c] == shape}, -math.inf, float(most))

    # ---- HiGHS -----------------------------------------------------------------------------------------
    def solve(self, t0: float) -> Solution:
        p, v = self.p, self.v
        nvars = len(v.lo)
        bounds = Bounds(np.array(v.lo), np.array(v.hi))
        integrality = np.zeros(len(v.integer)) if p.relaxed else np.array(v.integer)
        constraint = self.rows.constraint(nvars)
        options = {"mip_rel_gap": MIP_GAP, "time_limit": p.time_limit_s, "disp": False}
        cost_vec = np.zeros(nvars)
        for var, coef in self.cost_terms.items():
            cost_vec[var] = coef
        rate = self.rate
        if self.fixed_rate:
            res = quietly(milp, cost_vec, integrality=integrality, bounds=bounds, constraints=constraint,
                          options=options)
            _check(res, "serve the rate within the devices available" + (" and the budget" if p.budget else ""))
        else:
            obj = np.zeros(nvars)
            obj[self.rate_var] = -1.0
            res = quietly(milp, obj, integrality=integrality, bounds=bounds, constraints=constraint, options=options)
            _check(res, "serve any rate within the budget and the devices available")
            best = float(res.x[self.rate_var])
            # The cheapest plan at (nearly) that rate among these replicas: the first solve is indifferent to
            # replicas it leaves idle. Only removing replicas is tried (a small MILP: the counts found are bounds).
            lo, hi = np.array(v.lo), np.array(v.hi)
            lo[self.rate_var] = best * RATE_KEPT
            for c in range(self.nc):
                hi[self.n_var[c]] = min(hi[self.n_var[c]], round(res.x[self.n_var[c]]))
            again = quietly(milp, cost_vec, integrality=integrality, bounds=Bounds(lo, hi), constraints=constraint,
                            options=options)
            if again.x is not None and again.status in (0, 1):
                res = again
            else:
                self.notes.append("trimming idle replicas found nothing; the first plan is kept")
            rate = float(res.x[self.rate_var])
        if res.status == 1:
            self.notes.append(f"HiGHS stopped at its time limit ({p.time_limit_s:g} s); the plan is the best it found")
        return self._solution(res.x, rate, t0)

    def _solution(self, x: np.ndarray, rate: float, t0: float) -> Solution:
        cols, nc, nb = self.cols, self.nc, self.nb
        counts = np.array([x[self.n_var[c]] if self.p.relaxed else round(x[self.n_var[c]]) for c in range(nc)],
                          dtype=float if self.p.relaxed else int)
        ent = np.zeros((nc, nb))
        for (c, b), (var, unit) in self.entry.items():
            ent[c, b] = max(0.0, x[var] * unit)
        missed = np.zeros((nc, nb))
        for (c, b), var in self.miss.items():
            missed[c, b] = max(0.0, x[var])
        ent += missed
        dcd = np.zeros((nc, nb))
        for (c, b), var in self.dec.items():
            dcd[c, b] = max(0.0, x[var])
        flows = {k: float(x[var]) for k, var in self.flow.items() if x[var] > 1e-9}
        cost = float(sum(coef * counts[c] for c, coef in ((c, self.price[cols.group[c]] * cols.devices[c])
                                                           for c in range(nc))))
        return Solution(rate, counts, ent, dcd, flows, cost, time.perf_counter() - t0, tuple(self.notes),
                        missed=missed if self.miss else None)


def _subset(p: Problem, keep: list[int]) -> Problem:
    cols = p.columns

    def pick(seq: Sequence) -> list:
        return [seq[k] for k in keep]

    sub = Columns(pick(cols.model), pick(cols.group), pick(cols.devices), pick(cols.role),
                  pick(cols.shape) if cols.shape else ())
    return replace(p, columns=sub, capacity=np.asarray(p.capacity)[keep],
                   counts=None if p.counts is None else pick(p.counts),
                   capacity_any=None if p.capacity_any is None else np.asarray(p.capacity_any)[keep])


def _widen(p: Problem, keep: list[int], s: Solution) -> Solution:
    nc, nb = len(p.columns), np.asarray(p.capacity).shape[1]
    counts, entry, decode = np.zeros(nc, dtype=int), np.zeros((nc, nb)), np.zeros((nc, nb))
    counts[keep], entry[keep], decode[keep] = s.counts, s.entry, s.decode
    missed = None
    if s.missed is not None:
        missed = np.zeros((nc, nb))
        missed[keep] = s.missed
    return replace(s, counts=counts, entry=entry, decode=decode, missed=missed)


def solve_fast(problem: Problem, time_limit_s: float = TIME_LIMIT_S) -> Solution:
    """:func:`solve` the quick way: the linear relaxation (a bound), then the MILP over the configurations the
    relaxation uses (small, quick); when that is not within :data:`MIP_GAP` of the bound and the whole MILP is
    small (at most :data:`WHOLE_MILP_COLUMNS` configurations), or the small one has no plan, the whole MILP
    (``time_limit_s`` at most), the better answer kept. Its ``bound`` says how near the best it is. The same
    problem gives the same plan on any machine (no answer depends on a clock unless the safety limit is hit)."""
    t0 = time.perf_counter()
    lp = solve(replace(problem, relaxed=True))
    given = problem.rate is not None
    bound = lp.cost if given else lp.rate
    used = [c for c in range(len(problem.columns)) if lp.counts[c] > 1e-9]
    best: Solution | None = None
    if used and problem.slices is None:
        try:
            best = _widen(problem, used, solve(_subset(problem, used)))
        except PlanError:
            best = None

    def value(s: Solution) -> float:
        return -s.cost if given else s.rate

    short = best is not None and abs(value(best) - (-bound if given else bound)) > MIP_GAP * abs(bound)
    if best is None or (short and sum(1 for c in lp.counts) <= WHOLE_MILP_COLUMNS):
        try:
            full = solve(replace(problem, time_limit_s=time_limit_s))
            if best is None or value(full) > value(best):
                best = full
        except PlanError:
            if best is None:
                raise
    assert best is not None
    return replace(best, bound=bound, rate_given=given, seconds=time.perf_counter() - t0)


def _check(res, what: str) -> None:
    if res.x is None or res.status not in (0, 1):
        if res.status == 2:
            raise PlanError(f"no plan can {what}; give more devices, a larger budget or a lower rate, or relax "
                            "the SLO")
        raise PlanError(f"the MILP solver stopped without a plan ({res.message}); give fewer configurations or "
                        "buckets")
