"""``profile_hardware``: measure collectives, matmul, memory bandwidth and attention on this machine.

Run it in every process of a torchrun world (``flexmesh profile hardware --nproc N`` launches one):

- collectives: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv (a pairwise
  exchange, as ring attention and pipeline stages use it) over power-of-two message sizes, for
  every power-of-two group size up to the world; groups are consecutive ranks (``intra`` while a
  group fits in one node, ``inter`` beyond), and with several nodes also one rank per node
  (``inter``). All groups of a size run at once, as they do in training. The times are kept (the cost
  model prices by them: :func:`flexmesh.profile.timing.measured_curve`) and fitted as alpha + beta * bytes.
- matmul throughput: square matmuls, fp32 (and bf16 on a GPU), the best size's FLOP/s.
- memory bandwidth: a large tensor copy (read + write bytes over time); the optimizer is bound by it.
- overlap: an all-gather over all ranks (``overlap_bytes``, about one layer's weights) alone, a
  loop of matmuls about twice as long alone, and both at once (the all-gather asynchronous, as
  FSDP prefetches and DDP buckets run), the three in turn in each round of repeats (a machine
  under load slows all three alike), each the median of its rounds.
  ``hidden_fraction = (t_compute + t_collective - t_both) / min(t_compute, t_collective)``, clipped
  to [0, 1]: the share of overlapped communication really saved (1 on GPUs whose copy engines run
  beside the SMs; little on CPU, where gloo's threads take the cores the compute needs). The cost
  model charges ``comm - hidden_fraction * min(comm, compute)``.
- attention: :func:`flexmesh.runtime.model.attention_kernels.local_attention` (the kernel the runtime's
  rule picks for the device and dtype, named in the profile) over one document of T tokens; fit
  ``t = alpha + c * T^2``; throughput = the cost model's causal attention FLOPs per squared token
  (``2 * heads * head_dim``) over ``c``. On CPU the kernel masks a dense T x T score matrix, so this
  "effective" throughput is half the raw one; that is the point.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from flexmesh.profile.fit import fit_alpha_beta, fit_linear
from flexmesh.profile.format import CollectiveFit, HardwareProfile, produced_by
from flexmesh.profile.runner import World, device_memory_bytes, median_time, progress, synchronize

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ATTN_HEADS, ATTN_HEAD_DIM = 8, 64


def sweep(quick: bool, device: torch.device) -> dict:
    """Sizes of each measurement; ``quick`` is the small sweep (seconds, not minutes)."""
    gpu = device.type == "cuda"
    if quick:
        return {"message_bytes": [2**k for k in range(12, 23, 2)], "reps": 9, "matmul": [256, 512],
                "copy_bytes": 2**24, "attention_tokens": [256, 512, 768, 1024], "overlap_bytes": 2**22}
    return {"message_bytes": [2**k for k in range(10, 27 if gpu else 25)], "reps": 5, "overlap_bytes": 2**22,
            "matmul": [512, 1024, 2048, 4096] if gpu else [256, 512, 1024],
            "copy_bytes": 2**28 if gpu else 2**26,
            "attention_tokens": [512, 1024, 2048, 4096, 8192] if gpu else [256, 512, 1024, 1536, 2048]}


def _groups(world: World) -> list[tuple[int, str, list[list[int]]]]:
    """(group size, scope, partition of all ranks into groups) for every group layout to measure."""
    out = []
    g = 2
    while g <= world.size:
        parts = [list(range(s, s + g)) for s in range(0, world.size, g)]
        out.append((g, "intra" if g <= world.local_size else "inter", parts))
        g *= 2
    if world.nodes > 1:  # one rank per node
        g = 2
        while g <= world.nodes and g <= world.local_size:
            parts = [[n * world.local_size + local for n in range(s, s + g)]
                     for local in range(world.local_size) for s in range(0, world.nodes, g)]
            out.append((g, "inter", parts))
            g *= 2
    return out


# torch 2.13 renamed the tensor-in/tensor-out collectives; the old names still work in older releases.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _collective_fn(kind: str, nbytes: int, group, size: int, peer: int, device: torch.device):
    n = nbytes // 4  # float32 elements
    if kind == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_gather":
        inp, out = torch.ones(n // size, device=device), torch.empty(n, device=device)
        return lambda: _all_gather(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(n, device=device), torch.empty(n // size, device=device)
        return lambda: _reduce_scatter(out, inp, group=group)
    if kind == "all_to_all":
        inp, out = torch.ones(n, device=device), torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    send, recv = torch.ones(n, device=device), torch.empty(n, device=device)

    def exchange() -> None:
        for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            r.wait()
    return exchange


def _measure_collectives(world: World, cfg: dict, advance) -> list[CollectiveFit]:
    fits = []
    for size, scope, parts in _groups(world):
        mine, _ = dist.new_subgroups_by_enumeration(parts)
        members = next(p for p in parts if world.rank in p)
        for kind in COLLECTIVES:
            if kind == "send_recv" and size != 2:
                continue  # a message between two ranks; larger groups add nothing
            peer = members[1 - members.index(world.rank)] if size == 2 else -1
            times = []
            for nbytes in cfg["message_bytes"]:
                fn = _collective_fn(kind, nbytes, mine, size, peer, world.device)
                world.barrier()
                # two warm-up calls: the first collective on a new group also sets up its connections
                times.append(median_time(fn, cfg["reps"], world.device, warmup=2))
            times = world.medians(times)
            alpha, beta = fit_alpha_beta(cfg["message_bytes"], times)
            fits.append(CollectiveFit(kind, size, scope, alpha, beta, tuple(zip(cfg["message_bytes"], times))))
            advance(f"{kind} x{size} {scope}")
    return fits


def _measure_matmul(world: World, cfg: dict, dtypes: list[str]) -> dict:
    out = {}
    for name in dtypes:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        best = 0.0
        for n in cfg["matmul"]:
            a = torch.randn(n, n, device=world.device, dtype=dt)
            b = torch.randn(n, n, device=world.device, dtype=dt)
            world.barrier()
            t = world.medians([median_time(lambda: a @ b, cfg["reps"], world.device)])[0]
            best = max(best, 2.0 * n**3 / t)
        out[name] = best
    return out


def _measure_copy(world: World, cfg: dict) -> float:
    n = cfg["copy_bytes"] // 4
    src, dst = torch.ones(n, device=world.device), torch.empty(n, device=world.device)
    world.barrier()
    t = world.medians([median_time(lambda: dst.copy_(src), cfg["reps"], world.device)])[0]
    return 2.0 * cfg["copy_bytes"] / t


def _measure_overlap(world: World, cfg: dict) -> dict:
    """Collective alone, compute alone, both at once (see the module doc)."""
    dev, reps = world.device, cfg["reps"]
    n = cfg["overlap_bytes"] // 4 // world.size * world.size
    inp, out = torch.ones(n // world.size, device=dev), torch.empty(n, device=dev)
    a, b = torch.randn(256, 256, device=dev), torch.randn(256, 256, device=dev)
    world.barrier()
    t_comm, t_mm = world.medians([median_time(lambda: _all_gather(out, inp), reps, dev, warmup=2),
                                  median_time(lambda: a @ b, reps, dev)])
    k = max(1, round(2 * t_comm / t_mm))  # the same on every rank: both medians are shared

    def compute() -> None:
        for _ in range(k):
            a @ b

    def both() -> None:
        work = _all_gather(out, inp, async_op=True)
        compute()
        work.wait()

    # The three measured in turn, ``reps`` rounds of collective, compute, both: a machine whose speed
    # drifts (other processes on its cores) moves the three alike, where three separate series of
    # repeats, seconds apart, could see different speeds and put ``both`` under ``compute``.
    comm_s: list[float] = []
    compute_s: list[float] = []
    both_s: list[float] = []
    both()  # warm-up of the asynchronous path
    for _ in range(reps):
        for fn, times in ((lambda: _all_gather(out, inp), comm_s), (compute, compute_s), (both, both_s)):
            world.barrier()
            synchronize(dev)
            t0 = time.perf_counter()
            fn()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
    t_comm, t_compute, t_both = world.medians([statistics.median(t) for t in (comm_s, compute_s, both_s)])
    hidden = (t_compute + t_comm - t_both) / min(t_compute, t_comm)
    return {"hidden_fraction": min(1.0, max(0.0, hidden)), "collective": "all_gather",
            "message_bytes": n * 4, "collective_s": t_comm, "compute_s": t_compute, "both_s": t_both}


def _measure_attention(world: World, cfg: dict, dtypes: list[str]) -> dict:
    from flexmesh.runtime.model.attention_kernels import local_attention, select_kernel

    out = {}
    for name in dtypes:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        times = []
        for tokens in cfg["attention_tokens"]:
            q, k, v = (torch.randn(1, ATTN_HEADS, tokens, ATTN_HEAD_DIM, device=world.device, dtype=dt)
                       for _ in range(3))
            cu = torch.tensor([0, tokens], dtype=torch.int32, device=world.device)
            world.barrier()
            times.append(median_time(lambda: local_attention(q, k, v, cu), cfg["reps"], world.device))
        times = world.medians(times)
        sq = [float(t) ** 2 for t in cfg["attention_tokens"]]
        alpha, c = fit_linear(sq, times)
        flops = 2.0 * ATTN_HEADS * ATTN_HEAD_DIM / c if c > 0 else math.inf
        out[name] = {"alpha_s": alpha, "s_per_sq_token": c, "flops_per_s": flops, "heads": ATTN_HEADS,
                     "head_dim": ATTN_HEAD_DIM,
                     "kernel": select_kernel(world.device.type, dt, None, ATTN_HEAD_DIM).name,
                     "samples_tokens_s": [list(x) for x in zip(cfg["attention_tokens"], times)]}
    return out


def profile_hardware(quick: bool = False, show_progress: bool = True,
                     world: World | None = None) -> HardwareProfile | None:
    """Measure this machine; every process of the world calls it, rank 0 gets the profile (others None)."""
    world = world or World()
    cfg = sweep(quick, world.device)
    gpu = world.device.type == "cuda"
    dtypes = ["fp32", "bf16"] if gpu else ["fp32"]
    layouts = _groups(world)
    n_coll = sum(len(COLLECTIVES) - (0 if size == 2 else 1) for size, _, _ in layouts)
    with progress(show_progress and world.is_main, "profiling hardware", n_coll + 4) as advance:
        matmul = _measure_matmul(world, cfg, dtypes)
        advance("matmul")
        bandwidth = _measure_copy(world, cfg)
        advance("memory copy")
        attention = _measure_attention(world, cfg, dtypes)
        advance("attention")
        collectives = _measure_collectives(world, cfg, advance) if world.size > 1 else []
        overlap = _measure_overlap(world, cfg) if world.size > 1 else {}
        advance("overlap")
    if not world.is_main:
        return None
    pb = produced_by(processes=world.size, device_count=world.size, device_type=world.device.type)
    device = {"type": world.device.type, "name": pb["device_name"], "nodes": world.nodes,
              "devices_per_node": world.local_size, "memory_bytes": device_memory_bytes(world.device, world.local_size)}
    return HardwareProfile(device=device, dtype="bf16" if gpu else "fp32", matmul_flops_per_s=matmul,
                           memory_bytes_per_s=bandwidth, attention=attention, collectives=collectives,
                           produced_by=pb, name=f"hardware-{pb['hostname']}", overlap=overlap)
