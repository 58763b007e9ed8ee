"""Compressed expert all-to-all (LSH-MoE: flexmesh.runtime.parallel.lsh, `train --expert-lsh`).

What it must keep: a hash finer than the tokens (every token alone in its bucket) is the uncompressed layer, its
outputs and gradients; equal tokens share a centroid and come back as the expert's output of it; a coarse hash
sends fewer rows than routed pairs, and says so in the step's metrics; the cost model prices the all-to-all and the
experts' rows by the same ratio, and the hash's own work. This file is also the worker.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import flexmesh_here, launch, make_steps, train_config

from flexmesh.runtime.parallel.lsh import CrossPolytope


def moe_spec():
    from flexmesh.spec.model import ModelSpec
    from flexmesh.spec.moe import MoESpec

    return ModelSpec(name="test-moe", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                     vocab=256, dtype="fp32", max_position=1024, moe=MoESpec(4, 2, 48))


def test_equal_tokens_share_a_centroid_and_lone_tokens_pass_unchanged():
    torch.manual_seed(0)
    lsh = CrossPolytope(hidden=16, dim=8, hashes=2, seed=3)
    a, b = torch.randn(16), torch.randn(16)
    x = torch.stack([a, a, b, a])
    group = torch.tensor([0, 0, 0, 1])  # the last a goes elsewhere: its own centroid
    c, members = lsh.compress(x, group)
    m = members.tolist()
    assert m[0] == m[1] != m[2] and len(set(m)) == 3 == c.shape[0]
    assert lsh.clusters_per_group(group, members, 2).tolist() == [2, 1]
    y = c * 2.0  # any expert's output of the centroids
    out = lsh.decompress(y, x, c, members)
    torch.testing.assert_close(out, x * 2.0)  # equal tokens: the residual is zero
    # near tokens share a bucket; each gets the centroid's output plus its own offset from the centroid
    near = torch.stack([a, a + 1e-3 * torch.randn(16)])
    c, members = lsh.compress(near, torch.zeros(2, dtype=torch.long))
    assert members.tolist() == [0, 0]
    out = lsh.decompress(c * 0.0, near, c, members)
    torch.testing.assert_close(out, near - c[0])


def worker(out: Path) -> None:
    import torch.distributed as dist

    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    try:
        st = StagePlan(0, 2, tuple(LayerStrategy.parse("tp1-dp2z2") for _ in range(2)))
        plan = Plan.uniform(model="test-moe", cluster="cpu", world_size=2, pp=1, pipeline_schedule="1f1b",
                            num_microbatches=1, seq_len=256, global_batch=8, stages=(st,))
        report: dict = {}
        for name, lsh in (("plain", None), ("coarse", (1, 1))):
            trainer = Trainer(plan, moe_spec(), dataclasses.replace(train_config(), expert_lsh=lsh))
            rows = []
            for docs, schedule in make_steps(2, 1, steps=3, cut=False):
                m = trainer.step(docs, schedule)
                rows.append({"loss": m.loss, "ratio": m.expert_a2a_ratio})
            report[name] = rows
            dist.barrier()
        # one MoE layer's exchange on distinct tokens: uncompressed, hashed finer than the tokens, hashed coarsely
        from flexmesh.runtime.model.moe import moe_feed_forwards

        ff = next(iter(moe_feed_forwards(trainer.inner_models()[0]).values()))
        torch.manual_seed(100 + dist.get_rank())
        x0 = torch.randn(40, 64)
        chosen = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
        weights = torch.rand(40, 2)
        layer = {}
        ff.experts.gate_up.grad = ff.experts.down.grad = None  # what the last step left
        for name, lsh in (("plain", None), ("fine", (64, 4)), ("coarse", (1, 1))):
            ff.dispatch.lsh = None if lsh is None else CrossPolytope(64, *lsh, seed=7)
            ff.dispatch.sent = None
            x = x0.clone().requires_grad_(True)
            y = ff.dispatch(ff.experts, x, weights, chosen)
            (y * torch.linspace(-1, 1, 64)).sum().backward()
            gate_up = ff.experts.gate_up.grad
            local = gate_up.to_local() if hasattr(gate_up, "to_local") else gate_up
            layer[name] = {"y": y.detach().tolist(), "dx": x.grad.tolist(), "dw": local.tolist(),
                           "sent": ff.dispatch.sent.tolist()}
            ff.experts.gate_up.grad = None
            ff.experts.down.grad = None
        report["layer"] = layer
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps(report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_hash_finer_than_the_tokens_is_the_uncompressed_layer_and_a_coarse_one_sends_less(tmp_path):
    proc = launch(2, ["worker", str(tmp_path)], script=__file__, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "report.json").read_text())
    layer = {k: {f: torch.tensor(v) for f, v in d.items()} for k, d in r["layer"].items()}
    plain, fine, coarse = layer["plain"], layer["fine"], layer["coarse"]
    for field in ("y", "dx", "dw"):  # every token alone in its bucket: the uncompressed layer's outputs and gradients
        torch.testing.assert_close(fine[field], plain[field], rtol=1e-6, atol=1e-7)
    assert fine["sent"].tolist() == plain["sent"].tolist() == [80, 80]  # rows sent, routed pairs: one each
    assert coarse["sent"][0] < 0.5 * coarse["sent"][1]  # 2 buckets per (rank, expert): a few centroids
    assert not torch.allclose(coarse["y"], plain["y"], rtol=1e-3)  # an approximation
    assert all(row["ratio"] == 1.0 for row in r["plain"])  # the step's metrics: rows over pairs
    assert all(0 < row["ratio"] < 0.5 for row in r["coarse"]) and all(row["loss"] > 0 for row in r["coarse"])


def test_the_cost_model_prices_the_compressed_all_to_all():
    from flexmesh.cost.training.experts import ExpertParallel, expert_gemm_times, moe_communication, moe_memory_bytes
    from flexmesh.spec.model import parse_model

    model = parse_model("tiny-moe")
    plain, lsh = ExpertParallel(), ExpertParallel(lsh=(16, 1))
    ratio = lsh.a2a_ratio(4096 * 2 / 8)
    assert 0.0 < ratio < 0.05  # 32 buckets for ~1000 pairs an expert

    def a2a(kind, size, shape):  # noqa: ANN001, ANN202 - seconds linear in bytes
        return size * 1e-9

    cluster = dataclasses.make_dataclass("C", [("devices_per_node", int)])(8)
    full = moe_communication(a2a, cluster, model, plain, 8, 4096.0, False)
    small = moe_communication(a2a, cluster, model, lsh, 8, 4096.0, False)
    assert small[0] == pytest.approx(full[0] * ratio, rel=1e-9)  # the tokens' all-to-all shrinks
    assert small[2] == full[2]  # exact: the weights' exchange, the same operations
    measured = ExpertParallel(lsh=(16, 1), compression=0.2)
    assert moe_communication(a2a, cluster, model, measured, 8, 4096.0, False)[0] == pytest.approx(full[0] * 0.2)
    assert moe_memory_bytes(model, lsh) > moe_memory_bytes(model, plain)  # centroids summed, residuals added

    class Kernels:
        @staticmethod
        def linear(m, n, k):  # noqa: ANN001, ANN205 - seconds by flops
            return 2 * m * n * k * 1e-12, 4 * m * n * k * 1e-12

    f_plain, b_plain = expert_gemm_times(Kernels, model, 4096.0, plain, 8)
    f_lsh, b_lsh = expert_gemm_times(Kernels, model, 4096.0, lsh, 8)
    assert b_lsh < b_plain and f_lsh < f_plain  # the experts run the centroids


def test_expert_lsh_on_a_dense_model_is_refused_in_one_line(tmp_path):
    proc = flexmesh_here("plan", "--model", "tiny", "--cluster", "1xA100-80GB", "--seq-len", "512",
                         "--global-batch", "8", "--expert-lsh", "--out", str(tmp_path / "p.json"))
    assert proc.returncode != 0 and "has no experts; drop --expert-lsh" in proc.stderr, proc.stderr[-2000:]
    proc = flexmesh_here("plan", "--model", "tiny-moe", "--cluster", "1xA100-80GB", "--expert-lsh", "0x2",
                         "--out", str(tmp_path / "q.json"))
    assert proc.returncode != 0 and "DIMxHASHES" in proc.stderr


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]))
