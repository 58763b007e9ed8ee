"""The GPU's speed options, checked on CPU: compiled blocks, the chunked loss and metering on chosen steps.

- ``torch.compile`` of each block (flexmesh.runtime.parallel.parallelize.apply_compile) gives the eager
  model's loss and gradients, with one compiled code for every layer and every row length (the
  attention core stays out), however the layer is recomputed;
- the trainer with compiled blocks, the chunked loss and activations metered every other step, on
  two ranks (ZeRO-3, FSDP2), reproduces the single-process reference with a document cut over
  micro-batches, and meters exactly the steps it says, with one compiled code per rank. (Blocks
  compiled without FSDP, checkpointed or not: the first test; the same trainer on one rank ran the
  same steps through the same code, less FSDP's wrapping.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import launch, make_steps, reference_training, tiny_spec, train_config

from flexmesh.layout.step import Piece
from flexmesh.runtime.model.packing import pack_microbatch
from flexmesh.runtime.model.transformer import build_model
from flexmesh.runtime.parallel.parallelize import apply_ac, apply_compile
from flexmesh.runtime.state.weights import canonical_name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_blocks_match_the_eager_model_with_one_compilation_for_all_layers():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec = tiny_spec()
    eager, compiled = build_model(spec, "cpu"), build_model(spec, "cpu")
    # a checkpointed block is compiled inside its wrapper, a selectively recomputed one as a plain one
    apply_ac(compiled, (False, True, False, "selective"))
    apply_compile(compiled)
    rng = np.random.default_rng(0)
    graphs = []
    for sizes in (rng.integers(5, 60, size=4), rng.integers(5, 60, size=4), [1], rng.integers(5, 60, size=4)):
        docs = [rng.integers(0, spec.vocab, size=n) for n in sizes]  # three row lengths and a one-token row
        b = pack_microbatch(docs, [Piece(i, 0, len(d)) for i, d in enumerate(docs)])
        if b.num_tokens == 1:  # a label for the one token (a document's last token has none)
            b = replace(b, labels=torch.tensor([[7]]))
        _same_loss_and_grads(eager, compiled, b)
        graphs.append(counters["stats"]["unique_graphs"])
    # the blocks' own graphs (around the attention core: before it and after it, in the block and in its
    # attention), compiled once for any row length (no recompile at the second length, nor for the
    # one-token row, which runs eagerly) and not once per layer (4 layers: 4x as many) or per recompute
    assert 0 < graphs[0] <= 4 and graphs == [graphs[0]] * 4, (graphs, dict(counters["stats"]))
    # names as the eager model's (checkpoints do not depend on compilation); only the AC wrapper shows
    assert [canonical_name(n) for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_blocks_of_a_mixture_of_experts_match_the_eager_model():
    """The routed experts run outside the compiled graphs (their grouped kernel has no fp32 compiled
    form, their group sizes depend on the data): the rest of each block compiles, results unchanged."""
    from flexmesh.spec import MODEL_PRESETS

    torch._dynamo.reset()
    spec = replace(MODEL_PRESETS["tiny-moe"], dtype="fp32", num_layers=2)
    eager, compiled = build_model(spec, "cpu"), build_model(spec, "cpu")
    apply_compile(compiled)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, spec.vocab, size=n) for n in (40, 17, 33)]
    _same_loss_and_grads(eager, compiled, pack_microbatch(docs, [Piece(i, 0, len(d)) for i, d in enumerate(docs)]))


def _same_loss_and_grads(eager, compiled, b) -> None:  # noqa: ANN001
    """The loss of batch ``b`` and every gradient equal in the eager and the compiled model."""
    losses = []
    for m in (eager, compiled):
        m.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(b.tokens, b)[0], b.labels[0])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


STEPS = 3


def plan_for(world: int):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    z = "z0" if world == 1 else "z3"
    st = StagePlan(0, 4, tuple(LayerStrategy.parse(f"tp1-dp{world}{z}{ac}") for ac in ("", "-ac", "", "-sac")))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=1, pipeline_schedule="1f1b",
                num_microbatches=1, seq_len=256, global_batch=8, stages=(st,))


def worker(out: Path) -> None:
    import dataclasses

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    world = dist.get_world_size()
    cfg = replace(train_config(), compile=True, chunked_loss=True, meter_every=2)
    trainer = Trainer(plan_for(world), tiny_spec(), cfg)
    rows = [dataclasses.asdict(trainer.step(docs, sched)) for docs, sched in make_steps(world, 1, steps=STEPS)]
    graphs: list = [None] * world
    dist.all_gather_object(graphs, counters["stats"]["unique_graphs"])
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({"rows": rows, "chunked": trainer.chunked_loss, "graphs": graphs}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2])
def test_trainer_with_the_gpu_defaults_matches_the_reference(tmp_path, world):
    proc = launch(world, ["worker", str(tmp_path)], script=__file__, timeout=850)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["chunked"]
    want, _, _, _ = reference_training(make_steps(world, 1, steps=STEPS), train_config())
    for step, (row, w) in enumerate(zip(got["rows"], want, strict=True)):
        assert abs(row["loss"] - w) <= 1e-5 * w, f"step {step + 1}: {row['loss']} vs reference {w}"
        assert row["attention_kernel"] == "sdpa" and row["microbatch_tokens"] == plan_for(world).microbatch_tokens
    # one compiled code for every block on each rank: plain, checkpointed and selectively recomputed
    # layers (under FSDP2 with two ranks: blocks of two classes), rows of every length, the one-token
    # empty micro-batches included (as in the single-process test above)
    assert all(0 < g <= 4 for g in got["graphs"]), got["graphs"]
    metered = [bool(r["activation_peak_bytes"]) for r in got["rows"]]
    assert metered == [True, False, True]  # the first step, then every other (meter_every=2)
    assert all(len(r["activation_peak_bytes"]) == world for r in got["rows"] if r["activation_peak_bytes"])


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]))
