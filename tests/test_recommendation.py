"""The one-line policy recommendation of `flexmesh simulate`: the fastest policy against the runtime's
default and the term that makes the difference, or the default kept where nothing beats it."""

from flexmesh.sim.compare import PolicyRun, recommendation
from flexmesh.sim.groups import GroupsRun, groups_recommendation


def run(policy: str, step: float, *, imbalance: float = 1.0, padding: float = 0.0, busy: float = 0.8,
        label: str | None = None) -> PolicyRun:
    return PolicyRun(policy, label or policy, {}, (step, step), (1000, 1000), (imbalance,) * 2, (1.2, 1.2),
                     (0.001, 0.001), (busy, busy), (step, step), (padding, padding))


def test_the_faster_policy_is_recommended_with_the_term_that_differs():
    rec = recommendation([run("fixed", 1.0, imbalance=1.4, label="fixed (cp=8)"), run("hdp", 0.8, imbalance=1.05)])
    line = rec.line
    assert (rec.policy, rec.schedule, rec.against, round(rec.speedup, 2)) == ("hdp", "hdp", "fixed", 1.25)
    assert line.startswith("recommended: --policy hdp (hdp), 1.25x the tokens/s of the default fixed (cp=8)")
    assert "imbalance: fixed (cp=8) slowest data rank 1.40x the mean, hdp slowest data rank 1.05x" in line
    padded = recommendation([run("fixed", 1.0, padding=0.3), run("balanced", 0.8, padding=0.01)]).line
    assert "padding: fixed 30% padding, balanced 1% padding" in padded


def test_the_default_is_kept_where_no_policy_beats_it_and_a_losing_adaptive_is_explained():
    rec = recommendation([run("fixed", 1.0, busy=0.8), run("hdp", 1.25, busy=0.5), run("balanced", 0.99)])
    line = rec.line
    assert (rec.policy, rec.speedup) == ("fixed", 1.0) and rec.to_dict()["line"] == line
    assert line.startswith("recommended: the default --policy fixed (fixed): no policy here is 2% faster")
    assert "the best adaptive, hdp, gives 0.80x (why, idle time: hdp ranks busy 50% of the step, fixed ranks " \
           "busy 80%" in line


def test_a_plan_of_several_groups_is_told_the_dispatch_policy():
    def g(name: str, step: float, ratio: float) -> GroupsRun:
        return GroupsRun(name, [step], [step / ratio], 1000.0, 0.001)

    runs = [g("shares", 2.0, 1.9), g("shares+balanced", 1.9, 1.8), g("dispatch+balanced", 1.0, 1.1)]
    rec = groups_recommendation(runs)
    line = rec.line
    assert (rec.policy, rec.schedule, rec.against) == ("balanced", "dispatch+balanced", "shares")
    assert line.startswith("recommended: --policy balanced (dispatch+balanced), 2.00x the tokens/s of --policy shares")
    assert "shares's step is 1.90x its lower bound" in line and "1.10x" in line
    kept = groups_recommendation([g("shares", 1.0, 1.1), g("dispatch+hdp", 0.99, 1.1)])
    assert kept.policy == "shares"
    assert kept.line.startswith("recommended: --policy shares: no schedule here is 2% faster")


def test_a_policy_whose_scheduler_is_slower_than_the_step_is_not_recommended():
    slow = run("milp", 0.5)
    slow = PolicyRun(**{**slow.__dict__, "scheduler_seconds": (0.9, 0.9)})
    rec = recommendation([run("fixed", 1.0, imbalance=1.4), run("hdp", 0.6), slow])
    line = rec.line
    assert rec.left_out == ("milp",)
    assert line.startswith("recommended: --policy hdp (hdp)")
    assert "milp left out: its scheduler takes longer than the step here" in line
