"""Part (a) of bench/uneven_devices.py: the mixed-cluster planner against its baselines.

For each case: search time, the plan's predicted tokens/s, and the same for ``uniform`` (today's
planner, every device as the slowest type), ``proportional`` (a uniform layout's replicas with
batch shares by peak FLOP/s) and the sum of the parts planned alone, all priced by one cost model
(presets). Targets: case (a) >= 1.3x uniform, >= 0.9x the sum of the parts, search <= 10 s; (b), 1024
GPUs, >= 0.95x the sum of the parts, search <= 30 s; (c) and (d), 32 and 48 GPUs of three types, search
<= 10 s; the other ratios are shown against the same thresholds for reference. Times are wall-clock on
whatever shares the machine, the fastest of ``bench._results.REPEATS`` searches (the spread is printed): PASS/FAIL is
printed, not asserted.

Run: OMP_NUM_THREADS=1 python -m bench.mixed_plan
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from bench._results import fastest, markdown_table, record
from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.search.baselines import mixed_baselines
from flexmesh.search.mixed import plan_mixed
from flexmesh.search.mixed_types import TypePlans
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/search", "flexmesh/cost", "flexmesh/layout", "flexmesh/spec", "flexmesh/errors.py",
              "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py")

CASES = [  # (label, model, cluster, seq len, global batch, search-time target s, sum-of-parts target, asserted)
    ("a", "llama2-13b", "1x8xH100+2x8xA100-40GB", 4096, 256, 10.0, 0.9, True),
    ("b", "llama2-13b", "64x8xH100+64x8xA100-40GB", 4096, 2048, 30.0, 0.95, True),
    ("c", "llama3-8b", "1x8xH200+1x8xH100+2x8xA100-40GB", 8192, 128, 10.0, 0.9, False),
    ("d", "llama3-8b", "2x8xH200+2x8xH100+2x8xA100-40GB", 8192, 192, 10.0, 0.9, False),
]
UNIFORM_TARGET = 1.3


def run_case(model_name: str, cluster_name: str, seq: int, gb: int) -> dict:
    model, cluster = parse_model(model_name), parse_mixed_cluster(cluster_name)
    costs, result, search_s = fastest(lambda: MixedCosts(model, cluster),
                                      lambda c: plan_mixed(model, cluster, seq, gb, c),
                                      f"{model_name} on {cluster_name}: search")
    t1 = time.perf_counter()
    base = mixed_baselines(model, cluster, seq, gb, costs)
    tput = result.evaluation.tokens_per_s
    return {"search_s": search_s, "baselines_s": time.perf_counter() - t1, "tok_s": tput,
            "configs": result.configurations, "replicas": len(result.plan.groups),
            "unused": len(result.plan.unused), "layout": result.plan.layout.split("\n"),
            "uniform": base["uniform"]["tokens_per_s"] if base["uniform"] else 0.0,
            "proportional": base["proportional"]["tokens_per_s"] if base["proportional"] else 0.0,
            "parts": base["sum_of_parts"]["tokens_per_s"],
            "ceiling": typed_ceiling(costs, seq, gb, base["sum_of_parts"]["parts"])}


def typed_ceiling(costs: MixedCosts, seq: int, gb: int, parts: list[dict], step: int = 32,
                  spread: float = 0.25) -> tuple[float, int] | None:
    """(tokens/s, the first type's share) of the best plan of one replica group per device type on a
    cluster of two types, over every split of the batch in multiples of ``step`` within ``spread`` of
    the split in proportion to the types' throughputs alone (``parts``): each type's best plan alone
    for its share (flexmesh.search.mixed_types.TypePlans.alone, searched afresh for each split), the
    slower one setting the step. The all-reduce across the types is not counted, so no plan of one
    group per type with a share in that range beats it; the sum of the parts assumes any share runs
    at the rate of the whole batch. None for other than two types. ``costs``: the search's."""
    model, cluster = costs.model, costs.cluster
    if len(cluster.groups) != 2:
        return None
    target = gb * parts[0]["tokens_per_s"] / (parts[0]["tokens_per_s"] + parts[1]["tokens_per_s"])
    best: tuple[float, int] | None = None
    for b in range(step, gb, step):
        if abs(b - target) > spread * target:
            continue
        types = TypePlans(model, cluster, seq, gb, costs)  # afresh: the first pipelined plan sets the schedule
        a, c = types.alone(0, b), types.alone(1, gb - b)
        if a is not None and c is not None:
            tok = gb * seq / max(a.evaluation.step_time, c.evaluation.step_time)
            best = max(best or (0.0, 0), (float(tok), b))
    return best


def _verdict(ok: bool, asserted: bool) -> str:
    return ("PASS" if ok else "FAIL") if asserted else ("meets" if ok else "below") + " (reference)"


def main() -> None:
    rows, checks = [], []
    for label, model, cluster, seq, gb, time_target, parts_target, asserted in CASES:
        case = f"({label}) {model}, {cluster}, seq {seq}, gb {gb}"
        print(f"running {case} ...", flush=True)
        x = run_case(model, cluster, seq, gb)

        def ratio(k: str, x: dict = x) -> float:
            return x["tok_s"] / x[k] if x[k] else float("inf")

        distinct = sorted(set(x["layout"]), key=x["layout"].index)
        rows.append([case, f"{x['search_s']:.2f}", x["configs"], f"{x['tok_s']:,.0f}", f"{x['uniform']:,.0f}",
                     f"{ratio('uniform'):.2f}x", f"{x['proportional']:,.0f}", f"{ratio('proportional'):.2f}x",
                     f"{x['parts']:,.0f}", f"{ratio('parts'):.2f}x",
                     f"{x['ceiling'][0]:,.0f} (share {x['ceiling'][1]})" if x["ceiling"] else "-",
                     f"{x['replicas']} replicas, {x['unused']} unused; "
                     + "; ".join(f"`{d.split(' ', 1)[1].replace('|', '/')}`" for d in distinct[:3])
                     + (" ..." if len(distinct) > 3 else "")])
        checks += [[case, "search time", f"<= {time_target:g} s", f"{x['search_s']:.2f} s",
                    _verdict(x["search_s"] <= time_target, True)],
                   [case, "plan / uniform", f">= {UNIFORM_TARGET}x", f"{ratio('uniform'):.2f}x",
                    _verdict(ratio("uniform") >= UNIFORM_TARGET, label == "a")],
                   [case, "plan / sum of the parts", f">= {parts_target}x", f"{ratio('parts'):.2f}x",
                    _verdict(ratio("parts") >= parts_target, asserted)]]
    columns = ["case", "search s (fastest of 3)", "configurations", "plan tokens/s", "uniform", "plan/uniform",
               "proportional", "plan/prop.", "sum of parts", "plan/parts", "one group per type, best share",
               "plan (distinct replica layouts)"]
    table = Table(title="mixed-cluster planner against its baselines (one cost model)")
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*map(str, r))
    Console(width=220).print(table)
    check = Table(title="targets")
    for col in ("case", "what", "target", "measured", "verdict"):
        check.add_column(col, overflow="fold")
    for r in checks:
        check.add_row(*r)
    Console(width=220).print(check)
    body = "\n".join([
        *markdown_table(columns, rows), "",
        *markdown_table(["case", "what", "target", "measured", "verdict"], checks), "",
        "Predicted figures from the device presets (no profiles). Search time is the mixed-cluster search "
        "alone (the baselines run the uniform planner three times more); the machine is a shared 2-core "
        "box, so times are upper bounds. `sum of parts` plans each device type alone with the whole global "
        "batch (no gradient all-reduce across the types, which one plan pays), as if a type's share ran at the "
        "rate of the whole batch; `one group per type, best share` (two types only) is the best such plan "
        "over every split of the batch in steps of 32 sequences within 25% of the split in proportion to "
        "the parts (each type's own best plan for its share, the all-reduce across them not counted: a "
        "ceiling of plans of one group per type), with the first type's share.",
    ])
    record("mixed_plan", body, headline="plan over uniform / over the sum of the parts: " + ", ".join(
        f"{r[0].split()[0]} {r[5]} / {r[9]}" for r in rows))


if __name__ == "__main__":
    main()
