"""Another engine's admission rule is one scheduler class, and another engine one registry row: a toy of each, added
here alone, changes what the simulator does and what ``serve export`` writes."""

from __future__ import annotations

import json

import pytest

from flexmesh.data.requests import constant_lengths, with_arrivals
from flexmesh.serve import engines, schedulers
from flexmesh.serve.engines import EngineKind
from flexmesh.serve.export import EXAMPLE_PLAN, launches
from flexmesh.serve.layout.engine import EngineSpec
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster


class WholePrompts:
    """No chunked prefill (vLLM before it, FasterTransformer): a waiting request is admitted only when its whole
    prompt fits the budget left, and computed in one iteration."""

    def __init__(self) -> None:
        self.taken: list[tuple[int, int, int]] = []  # (request, tokens computed now, its prompt)

    def fill(self, rep, budget, chunks, now):
        while budget > 0 and rep.has_seat():
            head = rep.waiting.peek()
            if head is None or head.tokens - head.computed > budget or not rep.admit(head, budget, now):
                break
            n = head.tokens - head.computed
            rep.take(head, n, chunks)
            self.taken.append((head.r.id, n, head.r.prompt_tokens))
            budget -= n
        return budget


def toy_argv(k: EngineKnobs, tp, pp, role, model, host, port) -> list[str]:
    return ["toyserve", model, "--tp", str(tp), "--batch", str(k.max_batched_tokens), "--port", str(port)]


@pytest.fixture
def toy():
    made: list[WholePrompts] = []

    def make() -> WholePrompts:
        made.append(WholePrompts())
        return made[-1]

    schedulers.SCHEDULERS["whole-prompts"] = make
    engines.register(EngineKind("toy", "Toy", argv=toy_argv))
    yield made
    del schedulers.SCHEDULERS["whole-prompts"], engines.ENGINES["toy"]


TOY = EngineSpec(name="toy", title="Toy", kind="toy", scheduler="whole-prompts")


def _fleet(engine: str | EngineSpec) -> Fleet:
    c = parse_mixed_cluster("1xH100")
    knobs = {0: EngineKnobs(max_seqs=64, max_batched_tokens=2048)}
    return Fleet(parse_model("llama3-8b"), c, place(parse_replicas("tp1", c), c), knobs, engine=engine)


def test_a_scheduler_registered_alone_decides_what_the_replicas_admit(toy):
    work = with_arrivals(constant_lengths(1500, 20), rate=40.0, n=60)
    whole = _fleet(TOY).run(work)
    chunked = _fleet("vllm").run(work)
    assert len(whole.records) == len(chunked.records) == 60
    taken = [t for s in toy for t in s.taken]
    assert sorted(r for r, _, _ in taken) == list(range(60))  # each prompt admitted once
    assert all(n == prompt for _, n, prompt in taken)  # and computed whole
    # vLLM's scheduler chunks prompts that do not fit the budget left: its first tokens come sooner, or the
    # toy made no difference
    assert [r.first_token_s for r in whole.records] != [r.first_token_s for r in chunked.records]


def test_an_engine_registered_alone_is_exported_and_simulated(toy, tmp_path):
    plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
    cmds = launches("toy", plan, "/models/m", base_port=9000)
    assert [c.argv[:2] for c in cmds] == [("toyserve", "/models/m")] * 2
    assert [c.argv[c.argv.index("--tp") + 1] for c in cmds] == ["2", "1"] and [c.port for c in cmds] == [9000, 9001]
    path = tmp_path / "plan.json"
    path.write_text(EXAMPLE_PLAN)
    from flexmesh.cli import main

    assert main(["serve", "export", "--plan", str(path), "--engine", "toy", "--out", str(tmp_path / "out")]) == 0
    script = (tmp_path / "out" / "launch-toy.sh").read_text()
    assert script.count("toyserve /models/m") == 0 and script.count("toyserve llama3.1-8b") == 2
    assert "not checked (no argument parser of Toy is known)" in script
    assert _fleet(TOY).engine.scheduler_name == "whole-prompts"


def test_unknown_engines_and_schedulers_are_one_line():
    from flexmesh.errors import SpecError

    with pytest.raises(SpecError, match="unknown engine 'nope': give a preset \\(vllm, vllm-v0, sglang, trtllm, "
                       "distserve, transformers\\) or a .toml/.json description"):
        _fleet("nope")
    with pytest.raises(SpecError, match="unknown replica scheduler 'nope'"):
        _fleet(EngineSpec(name="x", title="X", kind="vllm", scheduler="nope"))
    with pytest.raises(SpecError, match="does not export transformers' continuous batching"):
        launches("transformers", ServingPlan.from_dict(json.loads(EXAMPLE_PLAN)), "/m")
