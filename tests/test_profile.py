"""Profiles: fits recover known coefficients, files round-trip, bad files fail clearly, the cost model obeys them."""

import doctest
import importlib
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flexmesh.cost import CostModel, GroupShape, Work
from flexmesh.cost.device.kernels import Kernels
from flexmesh.errors import ProfileError
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.profile import (
    CollectiveFit,
    HardwareProfile,
    LayerFit,
    ModelProfile,
    ProfiledTiming,
    cluster_from_profile,
    cost_model_from_profiles,
    fit_alpha_beta,
    fit_layer_time,
    fit_linear,
    hardware_from_profile,
    load_profile,
)
from flexmesh.spec import MODEL_PRESETS, parse_cluster

TINY = MODEL_PRESETS["tiny"]


@pytest.mark.parametrize("name", ["flexmesh.profile.fit", "flexmesh.profile.format", "flexmesh.profile.timing",
                                  "flexmesh.profile.use"])
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


# ---- fits --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,beta", [(5e-5, 2e-9), (1e-3, 1e-10), (0.0, 4e-9)])
def test_alpha_beta_recovers_known_coefficients(alpha, beta):
    n = np.array([2.0**k for k in range(10, 26, 2)])
    a, b = fit_alpha_beta(n, alpha + beta * n)
    assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12) and b == pytest.approx(beta, rel=1e-6)


def test_alpha_beta_robust_to_one_outlier():
    rng = np.random.default_rng(0)
    n = np.array([2.0**k for k in range(10, 26)])
    t = (3e-5 + 1e-9 * n) * rng.uniform(0.98, 1.02, n.size)
    t[2] *= 20  # another process took the core during one sample
    a, b = fit_alpha_beta(n, t)
    assert a == pytest.approx(3e-5, rel=0.1) and b == pytest.approx(1e-9, rel=0.05)


def test_layer_fit_separates_per_document_and_whole_row_attention():
    rows = [[r] for r in (256, 512, 1024, 2048)] + [[r // 8] * 8 for r in (256, 512, 1024, 2048)] \
        + [[r // 2, r // 4, r // 8, r // 8] for r in (512, 2048)]
    tokens = np.array([sum(r) for r in rows], dtype=float)
    sq = np.array([sum(x * x for x in r) for r in rows], dtype=float)
    for true in (LayerFit(2e-4, 3e-6, 4e-9, 0.0), LayerFit(1e-4, 5e-6, 0.0, 2e-9), LayerFit(0.0, 1e-6, 1e-9, 1e-9)):
        got = fit_layer_time(tokens, sq, true.time(tokens, sq))
        for field in ("c0_s", "c1_s_per_token", "c2_s_per_sq_token", "c3_s_per_sq_row_token"):
            assert getattr(got, field) == pytest.approx(getattr(true, field), rel=1e-5, abs=1e-13), field


def test_fit_never_returns_negative_time_coefficients():
    x = np.array([100.0, 200, 400, 800])
    c0, c1 = fit_linear(x, 1e-6 * x - 1e-5 + np.array([0, 1e-6, 0, 1e-6]) + 2e-5)
    assert c0 >= 0 and c1 > 0


def test_too_few_samples_is_a_profile_error():
    with pytest.raises(ProfileError, match="widen the sweep"):
        fit_layer_time([256, 512], [256**2, 512**2], [1e-3, 2e-3])


# ---- files -------------------------------------------------------------------------------------------
def hardware_profile(**kw) -> HardwareProfile:
    d = dict(device={"type": "cpu", "name": "test cpu", "nodes": 1, "devices_per_node": 2, "memory_bytes": 4 * 2**30},
             dtype="fp32", matmul_flops_per_s={"fp32": 4e10}, memory_bytes_per_s=8e9,
             attention={"fp32": {"alpha_s": 0.0, "s_per_sq_token": 1e-9, "flops_per_s": 1e10}},
             collectives=[CollectiveFit(k, 2, "intra", a, b) for k, a, b in (
                 ("all_reduce", 2e-4, 2e-9), ("all_gather", 1e-4, 1e-9), ("reduce_scatter", 1e-4, 1.5e-9),
                 ("all_to_all", 5e-5, 1e-9), ("send_recv", 4e-5, 5e-10))],
             produced_by={"hostname": "test", "processes": 2}, name="hw.json")
    d.update(kw)
    return HardwareProfile(**d)


def model_profile(spec=TINY, **kw) -> ModelProfile:
    acts = [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 20000.0},
            {"tp": 1, "cp": 1, "recompute": True, "bytes_per_token": 1024.0},
            {"tp": 2, "cp": 1, "recompute": False, "bytes_per_token": 11000.0},
            {"tp": 2, "cp": 1, "recompute": True, "bytes_per_token": 512.0}]
    d = dict(model=spec.to_dict(), dtype="fp32",
             layer={"forward": LayerFit(1e-3, 5e-6, 1e-9, 2e-9), "backward": LayerFit(2e-3, 1e-5, 2e-9, 4e-9),
                    "backward_recompute": LayerFit(3e-3, 1.5e-5, 3e-9, 6e-9)},
             embedding={"forward": LayerFit(1e-5, 1e-8, 0, 0), "backward": LayerFit(2e-4, 0.0, 0, 0)},
             head={"forward": LayerFit(1e-4, 2e-5, 0, 0), "backward": LayerFit(2e-4, 4e-5, 0, 0)},
             activations={"layers": acts, "attention_mask_bytes_per_sq_row_token": 4.0,
                          "embedding_bytes_per_token": 8.0, "head_bytes_per_token": 33000.0},
             states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8,
                     "optimizer_step_s_per_param": 2e-9},
             produced_by={"hostname": "test", "processes": 1}, name="tiny.json")
    d.update(kw)
    return ModelProfile(**d)


def test_hardware_profile_round_trip(tmp_path):
    hw = hardware_profile()
    hw.save(tmp_path / "a.json")
    back = load_profile(tmp_path / "a.json", "hardware")
    assert back.to_dict() == hw.to_dict() and back.name == "a.json"


def test_model_profile_round_trip(tmp_path):
    mp = model_profile()
    mp.save(tmp_path / "m.json")
    back = load_profile(tmp_path / "m.json")
    assert isinstance(back, ModelProfile) and back.to_dict() == mp.to_dict()
    assert back.layer["backward"] == mp.layer["backward"]


def test_save_leaves_no_temporary_files(tmp_path):
    hardware_profile().save(tmp_path / "hw.json")
    assert [p.name for p in tmp_path.iterdir()] == ["hw.json"]


def _write(tmp_path, d, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def test_unknown_version_is_rejected(tmp_path):
    d = hardware_profile().to_dict()
    d["version"] = 99
    with pytest.raises(ProfileError, match="version 99 is not supported"):
        load_profile(_write(tmp_path, d))


def test_wrong_kind_is_rejected(tmp_path):
    path = _write(tmp_path, model_profile().to_dict())
    with pytest.raises(ProfileError, match="'model' profile, but a hardware profile is needed"):
        load_profile(path, "hardware")


def test_missing_keys_are_named(tmp_path):
    d = model_profile().to_dict()
    del d["layer"]["backward"]
    del d["states"]["optimizer_step_s_per_param"]
    with pytest.raises(ProfileError, match="missing layer.backward, states.optimizer_step_s_per_param"):
        load_profile(_write(tmp_path, d))


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not a JSON profile"):
        load_profile(tmp_path / "bad.json")


def test_profile_of_another_model_is_rejected(tmp_path):
    path = tmp_path / "tiny.json"
    model_profile().save(path)
    other = replace(TINY, name="tiny-wide", hidden=512)
    with pytest.raises(ProfileError, match="measured on model 'tiny', not 'tiny-wide'.*hidden 256 vs 512"):
        load_profile(path).check_model(other)
    with pytest.raises(ProfileError, match="not 'tiny-wide'"):
        cost_model_from_profiles(other, hardware=hardware_profile(), model=path)
    load_profile(path).check_model(replace(TINY, name="renamed", dtype="fp32"))  # same shape: accepted


def test_edited_model_hash_is_rejected(tmp_path):
    d = model_profile().to_dict()
    d["model"]["num_layers"] = 8
    with pytest.raises(ProfileError, match="model_hash does not match"):
        load_profile(_write(tmp_path, d))


# ---- hardware from a profile ---------------------------------------------------------------------------
def test_hardware_from_profile_uses_measured_alpha_beta_and_throughput():
    cluster = cluster_from_profile(hardware_profile(), 2)
    hw = hardware_from_profile(cluster, hardware_profile())
    assert hw.matmul_flops == 4e10 and hw.attn_flops == 1e10 and hw.hbm_bytes_per_s == 8e9
    assert hw.collective_time("all_reduce", 1e6, GroupShape(2, 2)) == pytest.approx(2e-4 + 2e-9 * 1e6)
    arr = hw.collective_time("send_recv", np.array([0.0, 1e6]), GroupShape(2, 2))
    assert np.allclose(arr, [4e-5, 4e-5 + 5e-10 * 1e6])
    assert hw.collective_time("all_to_all", 1e6, GroupShape(1, 1)) == 0.0


def test_unmeasured_group_size_scales_nearest_by_volume():
    hw = hardware_from_profile(parse_cluster("8xA100-80GB"), hardware_profile())
    # all-reduce of 8 from 2: beta x (7/8)/(1/2), alpha x 7/1
    t = hw.collective_time("all_reduce", 1e6, GroupShape(8, 8))
    assert t == pytest.approx(2e-4 * 7 + 2e-9 * 1.75 * 1e6)
    # inter-node group, only intra measured: same scaling from the other scope
    assert hw.collective_time("send_recv", 1e6, GroupShape(2, 1)) == pytest.approx(4e-5 + 5e-10 * 1e6)


def _knee_profile() -> HardwareProfile:
    """An all-gather over 2 ranks that is latency-bound to 64 KiB and bandwidth-bound past it (NCCL's
    protocol switch), with one noisy sample (the 1 MiB message timed faster than the 256 KiB one)."""
    sizes = [2**k for k in range(10, 25, 2)]
    times = [max(2e-5, b / 5e9) for b in sizes]
    times[5] = times[4] * 0.9  # 1 MiB timed below 256 KiB: noise, not physics
    knee = CollectiveFit("all_gather", 2, "intra", *fit_alpha_beta(sizes, times), tuple(zip(sizes, times)))
    rest = [c for c in hardware_profile().collectives if c.collective != "all_gather"]
    return hardware_profile(collectives=[knee, *rest])


def test_measured_samples_price_collectives_by_message_size():
    prof = _knee_profile()
    hw = hardware_from_profile(parse_cluster("8xA100-80GB"), prof)
    two = GroupShape(2, 8)
    (fit,) = [c for c in prof.collectives if c.collective == "all_gather"]
    # at measured sizes the measured times, where one line through all of them misses the knee
    assert hw.collective_time("all_gather", 2.0**16, two) == pytest.approx(2e-5)
    assert hw.collective_time("all_gather", 2.0**24, two) == pytest.approx(2.0**24 / 5e9)
    assert max(abs(fit.time(b) / t - 1) for b, t in fit.samples) > 0.2
    # between sizes log-log, beyond the largest the largest's bandwidth
    mid = hw.collective_time("all_gather", 2.0**23, two)
    assert 2.0**22 / 5e9 < mid < 2.0**24 / 5e9 and mid == pytest.approx(2.0**23 / 5e9)
    assert hw.collective_time("all_gather", 2.0**26, two) == pytest.approx(2.0**26 / 5e9)
    # a noisy sample never makes a larger message cheaper
    grid = np.geomspace(2.0**10, 2.0**24, 57)
    assert np.all(np.diff(hw.collective_time("all_gather", grid, two)) >= 0)
    # a group size not measured: the measured curve scaled by the ring's volume (7/8 against 1/2)
    assert hw.collective_time("all_gather", 2.0**24, GroupShape(8, 8)) == pytest.approx(2.0**24 / 5e9 * 1.75)
    # collectives the profile kept no samples of keep their fit
    assert hw.collective_time("all_reduce", 1e6, two) == pytest.approx(2e-4 + 2e-9 * 1e6)


def test_lower_envelope_of_measured_collectives_is_additive_and_below():
    cost = cost_model_from_profiles(TINY, hardware=_knee_profile(), world=2)
    env = cost.replace(kernels=Kernels.envelope).hw
    two = GroupShape(2, 2)
    grid = np.geomspace(2.0**8, 2.0**27, 40)
    assert np.all(env.collective_time("all_gather", grid, two) <= cost.hw.collective_time("all_gather", grid, two))
    a, b = 3e4, 7e5
    assert env.collective_time("all_gather", a + b, two) == pytest.approx(
        env.collective_time("all_gather", a, two) + env.collective_time("all_gather", b, two))
    # the measured model itself is not additive: two small messages pay the latency twice
    assert cost.hw.collective_time("all_gather", a, two) + cost.hw.collective_time("all_gather", a, two) > \
        cost.hw.collective_time("all_gather", 2 * a, two)


def test_single_process_profile_has_no_collectives():
    hw = hardware_from_profile(parse_cluster("2xA100-80GB"), hardware_profile(collectives=[]))
    with pytest.raises(ProfileError, match="--nproc"):
        hw.collective_time("all_reduce", 1e6, GroupShape(2, 2))


def test_cluster_from_profile_divides_cpu_memory_among_processes():
    hw = hardware_profile()  # 4 GiB per process for 2 processes: 8 GiB of RAM
    assert cluster_from_profile(hw, 4).device.memory_gib == pytest.approx(2.0)
    assert cluster_from_profile(hw).world_size == 2
    gpu = hardware_profile(device={**hw.device, "type": "cuda"})
    assert cluster_from_profile(gpu, 4).device.memory_gib == pytest.approx(4.0)


# ---- the cost model with a model profile -----------------------------------------------------------------
def cost(world=2, **kw):
    return cost_model_from_profiles(TINY, hardware=hardware_profile(), model=model_profile(**kw), world=world)


def test_source_names_both_profiles_and_dtype_is_the_profiles():
    c = cost()
    assert c.source == "profile:hw.json+tiny.json" and c.model.dtype == "fp32"
    preset = CostModel(TINY, parse_cluster("2xA100-80GB"), timing=ProfiledTiming(model_profile()))
    assert preset.source == "preset:A100-80GB+profile:tiny.json"


def test_layer_time_is_exactly_the_fitted_coefficients():
    c = cost()
    mp = model_profile()
    lengths = [1000, 24, 500]
    w = Work.from_lengths(lengths)
    T, sq = 1524.0, 1000**2 + 24**2 + 500**2
    for s, split in ((LayerStrategy(), 1), (LayerStrategy(tp=2), 2)):
        lc = c.layer(s, w)
        f, b = mp.layer["forward"], mp.layer["backward"]
        assert lc.fwd == pytest.approx(f.c0_s + (f.c1_s_per_token * T + f.c2_s_per_sq_token * sq
                                                 + f.c3_s_per_sq_row_token * T * T) / split)
        assert lc.bwd == pytest.approx(b.c0_s + (b.c1_s_per_token * T + b.c2_s_per_sq_token * sq
                                                 + b.c3_s_per_sq_row_token * T * T) / split)
    rc = c.layer(LayerStrategy(recompute=True), w)
    assert rc.bwd == pytest.approx(float(mp.layer["backward_recompute"].time(T, sq)))


def test_activation_bytes_come_from_the_table_with_fallback():
    c = cost()
    w = Work(tokens=2048.0, sq_tokens=2048.0**2)
    assert c.layer(LayerStrategy(), w).act == pytest.approx(20000 * 2048 + 4 * 2048**2)
    assert c.layer(LayerStrategy(tp=2), w).act == pytest.approx(11000 * 2048 + 4 * 2048**2)
    rc = c.layer(LayerStrategy(recompute=True), w)
    assert rc.act == pytest.approx(1024 * 2048)
    # recomputing holds the layer's measured activations on top of the working memory every layer has
    assert rc.transient - c.layer(LayerStrategy(), w).transient == pytest.approx(20000 * 2048 + 4 * 2048**2)
    # cp 2 was not measured: the tp=cp=1 value divided by tp*cp; the ring kernel keeps no mask
    ring = c.layer(LayerStrategy(cp=2, cp_kind="ring"), w)
    assert ring.act == pytest.approx(20000 / 2 * 2048)
    assert c.activation_bytes_per_token(LayerStrategy(tp=2), layers=4) == pytest.approx(4 * 11000)


def test_states_optimizer_and_ends_come_from_the_profile():
    c = cost()
    s = LayerStrategy()
    lc = c.layer(s, Work(tokens=100.0, sq_tokens=100.0**2))
    assert lc.states == pytest.approx(TINY.layer_params * (4 + 4 + 8))
    assert lc.optim == pytest.approx(TINY.layer_params * 2e-9)
    ends = c.ends(s, Work(tokens=1000.0, sq_tokens=1000.0**2), True, True)
    assert ends.fwd == pytest.approx((1e-5 + 1e-8 * 1000) + (1e-4 + 2e-5 * 1000))
    assert ends.bwd == pytest.approx(2e-4 + (2e-4 + 4e-5 * 1000))
    assert ends.transient == pytest.approx(33000 * 1000)


def test_microbatch_time_matches_layers_plus_ends():
    c = cost()
    s = LayerStrategy()
    t = c.microbatch_time(s, 1000.0, 1000.0**2)
    w = Work(tokens=1000.0, sq_tokens=1000.0**2)
    expect = 4 * (c.layer(s, w).fwd + c.layer(s, w).bwd) + c.ends(s, w, True, True).fwd + c.ends(s, w, True, True).bwd
    assert float(t) == pytest.approx(expect)


def test_whole_model_factors_scale_every_pass_and_old_profiles_read_as_one(tmp_path):
    s, w = LayerStrategy(), Work(tokens=1000.0, sq_tokens=1000.0**2)
    plain = cost()
    scaled = CostModel(TINY, parse_cluster("2xA100-80GB"), timing=ProfiledTiming(model_profile(
        whole_model={"layers": 4, "forward": 1.25, "backward": 1.1, "samples": []},
        parallel=parallel_section())))
    for st in (s, LayerStrategy(recompute=True), LayerStrategy(tp=2), LayerStrategy(cp=2, cp_kind="ring")):
        a, b = plain.timing.layer_times(st, 1000.0, 1000.0**2), scaled.timing.layer_times(st, 1000.0, 1000.0**2)
        if st.tp == 1 and st.cp == 1:
            assert (b.fwd, b.bwd, b.attention) == pytest.approx((1.25 * a.fwd, 1.1 * a.bwd, 1.25 * a.attention))
        else:  # timed under real groups: the measured fit, scaled
            fit = model_profile(parallel=parallel_section()).parallel_layer(st.tp, st.cp_kind, st.cp)
            assert b.fwd == pytest.approx(1.25 * float(fit["forward"].time(1000.0, 1000.0**2)))
            assert b.bwd == pytest.approx(1.1 * float(fit["backward"].time(1000.0, 1000.0**2)))
    ends_a, ends_b = plain.ends(s, w, True, True), scaled.ends(s, w, True, True)
    assert (ends_b.fwd, ends_b.bwd) == pytest.approx((1.25 * ends_a.fwd, 1.1 * ends_a.bwd))
    # a profile written before the whole-model measurement prices the parts as they are
    d = model_profile().to_dict()
    del d["whole_model"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "old.json").whole_factor("forward") == 1.0
    d["whole_model"] = {"layers": 4, "forward": -1.0, "backward": 1.0}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="whole_model.forward"):
        load_profile(tmp_path / "bad.json")


def test_whole_model_fixed_seconds_are_paid_once_per_micro_batch_with_the_head(tmp_path):
    s, w = LayerStrategy(), Work(tokens=1000.0, sq_tokens=1000.0**2)
    plain = cost()
    fixed = CostModel(TINY, parse_cluster("2xA100-80GB"), timing=ProfiledTiming(model_profile(
        whole_model={"layers": 4, "forward": 1.0, "forward_fixed_s": 0.004, "backward": 1.0,
                     "backward_fixed_s": 0.002, "samples": []})))
    for st in (s, LayerStrategy(tp=2)):  # the layers do not pay it
        a, b = plain.timing.layer_times(st, 1000.0, 1000.0**2), fixed.timing.layer_times(st, 1000.0, 1000.0**2)
        assert (b.fwd, b.bwd) == pytest.approx((a.fwd, a.bwd))
    head_a, head_b = plain.ends(s, w, False, True), fixed.ends(s, w, False, True)
    assert (head_b.fwd, head_b.bwd) == pytest.approx((head_a.fwd + 0.004, head_a.bwd + 0.002))
    emb_a, emb_b = plain.ends(s, w, True, False), fixed.ends(s, w, True, False)
    assert (emb_b.fwd, emb_b.bwd) == pytest.approx((emb_a.fwd, emb_a.bwd))
    # micro-batches priced together: each with tokens pays once, an empty one nothing
    tokens = np.array([1000.0, 0.0, 10.0])
    f_a, b_a = plain.timing.head_times(s, tokens)
    f_b, b_b = fixed.timing.head_times(s, tokens)
    assert f_b - f_a == pytest.approx([0.004, 0.0, 0.004]) and b_b - b_a == pytest.approx([0.002, 0.0, 0.002])
    d = model_profile().to_dict()
    d["whole_model"] = {"layers": 4, "forward": 1.0, "backward": 1.0, "forward_fixed_s": -0.1}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="whole_model.forward_fixed_s must be a finite number >= 0"):
        load_profile(tmp_path / "bad.json")


def test_pipeline_stage_fixed_seconds_are_paid_per_chunk_per_micro_batch(tmp_path):
    plain, staged = cost(world=4), cost(world=4, pipeline={"stage_fixed_s": 0.003, "stages": [1, 2, 4]})
    s = LayerStrategy()
    assert staged.pipeline_p2p(s, 1, 1024, pp=1) == plain.pipeline_p2p(s, 1, 1024, pp=1) == 0.0  # no pipeline
    assert staged.pipeline_p2p(s, 1, 1024, pp=2) == pytest.approx(plain.pipeline_p2p(s, 1, 1024, pp=2) + 0.003)
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):  # every chunk of a rank pays it, every micro-batch
        chunks = [[s] * (4 // (2 * v))] * (2 * v)
        a = plain.evaluate_stages(chunks, 2, schedule, 4, v, 1, 1024)
        b = staged.evaluate_stages(chunks, 2, schedule, 4, v, 1, 1024)
        assert np.subtract(b.stage_times, a.stage_times) == pytest.approx([0.003 * v] * 2)
        assert b.step_time > a.step_time
    one = [[s] * 4]
    assert staged.evaluate_stages(one, 1, "1f1b", 4, 1, 1, 1024).step_time == \
        plain.evaluate_stages(one, 1, "1f1b", 4, 1, 1, 1024).step_time
    d = model_profile(pipeline={"stage_fixed_s": 0.003}).to_dict()
    (tmp_path / "p.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "p.json").stage_fixed() == 0.003
    del d["pipeline"]  # a profile written before the measurement: no cost per stage
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "old.json").stage_fixed() == 0.0
    d["pipeline"] = {"stage_fixed_s": -1e-3}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="pipeline.stage_fixed_s must be a finite number >= 0"):
        load_profile(tmp_path / "bad.json")


@pytest.mark.slow
def test_measured_stage_cost_follows_the_framework_work_per_stage(monkeypatch):
    """A delay in each stage's forward shows up in the fitted cost per chunk, and nowhere else.

    The delay is added to the profiler's clock rather than slept (a sleep on a loaded machine wakes late
    by more than it lasts), so the fitted difference is the delay plus the noise of the real work only."""
    from flexmesh.profile import runner
    from flexmesh.profile.model import _measure_stages, sweep
    from flexmesh.profile.runner import World
    from flexmesh.runtime.parallel.pipeline import StageModule

    cfg, world = sweep(quick=True), World("cpu")
    before = _measure_stages(TINY, cfg, torch.float32, world.device, world)
    assert before["stages"] == [1, 2, 4] and len(before["step_s"]) == 3 and before["stage_fixed_s"] >= 0
    delay, added = 1.0, [0.0]  # seconds per chunk run: the real framework's (about 1 ms) and its noise are far below
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + added[0])
    forward = StageModule.forward

    def slow(self, *a, **kw):
        added[0] += delay
        return forward(self, *a, **kw)

    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(StageModule, "forward", slow)
    after = _measure_stages(TINY, cfg, torch.float32, world.device, world)
    assert 0.8 * delay < after["stage_fixed_s"] - before["stage_fixed_s"] < 1.2 * delay


def test_without_profiles_nothing_changes():
    cluster = parse_cluster("8xA100-80GB")
    a, b = CostModel(TINY, cluster), CostModel(TINY, cluster, hardware=None, timing=None)
    s = LayerStrategy(tp=2, zero=3, recompute=True)
    w = Work(tokens=4096.0, sq_tokens=4096.0**2)
    # exact: no profile: the same presets price both
    assert a.layer(s, w) == b.layer(s, w) and a.source == "preset:A100-80GB"


# ---- timings under real process groups, and overlap ---------------------------------------------------
def parallel_section():
    """tp 2 and ring cp 2 timed under real groups (coefficients unlike the one-process fits)."""
    return {"world_size": 2,
            "layers": [{"tp": 2, "cp": 1, "cp_kind": "none", "forward": LayerFit(5e-3, 4e-6, 1e-9, 0.0),
                        "backward": LayerFit(9e-3, 8e-6, 2e-9, 0.0),
                        "backward_recompute": LayerFit(1e-2, 1e-5, 3e-9, 0.0)},
                       {"tp": 1, "cp": 2, "cp_kind": "ring", "forward": LayerFit(2e-3, 0.0, 0.0, 7e-8),
                        "backward": LayerFit(4e-3, 0.0, 0.0, 9e-8),
                        "backward_recompute": LayerFit(5e-3, 0.0, 0.0, 1e-7)}],
            "ends": [{"tp": 2, **{k: LayerFit(1e-3 * (i + 1), 1e-5, 0.0) for i, k in enumerate(
                ("embedding_forward", "embedding_backward", "head_forward", "head_backward"))}}]}


def test_parallel_section_round_trips(tmp_path):
    mp = model_profile(parallel=parallel_section())
    mp.save(tmp_path / "m.json")
    back = load_profile(tmp_path / "m.json", "model")
    assert back.to_dict() == mp.to_dict()
    assert back.parallel_layer(1, "ring", 2)["forward"] == LayerFit(2e-3, 0.0, 0.0, 7e-8)
    assert back.parallel_layer(2, "ulysses", 1) is back.parallel_layer(2, "none", 1) is not None  # cp 1: no kind
    assert back.parallel_layer(1, "ulysses", 2) is None and back.parallel_ends(4) is None


def test_layers_timed_under_real_groups_replace_split_fits_and_their_communication():
    c = cost(parallel=parallel_section())
    base = cost()
    T, sq = 1024.0, 2 * 512.0**2
    w = Work(tokens=T, sq_tokens=sq)
    tp2 = c.layer(LayerStrategy(tp=2), w)
    sec = parallel_section()["layers"][0]
    assert tp2.fwd == pytest.approx(float(sec["forward"].time(T, sq)))
    assert tp2.bwd == pytest.approx(float(sec["backward"].time(T, sq)))
    assert tp2.comm_fwd == tp2.comm_bwd == 0.0  # the measured times include the tp collectives
    assert base.layer(LayerStrategy(tp=2), w).comm_fwd > 0.0  # without them the model adds its own
    ring = c.layer(LayerStrategy(cp=2, cp_kind="ring", recompute=True), w)
    assert ring.bwd == pytest.approx(5e-3 + 1e-7 * T * T)  # c0 + c3 * T^2 of backward_recompute, not split
    # a layout the profile did not time keeps the one-process fit split over tp x cp, plus modelled comm
    uly = c.layer(LayerStrategy(cp=2, cp_kind="ulysses"), w)
    assert uly.fwd == pytest.approx(float(model_profile().layer["forward"].time(T, sq, 2))) and uly.comm_fwd > 0
    # the ends under tp 2: each cp rank's own tokens through the tp-timed fits
    ends = c.ends(LayerStrategy(tp=2, cp=2, cp_kind="ulysses"), w, True, True)
    assert ends.fwd == pytest.approx((1e-3 + 1e-5 * T / 2) + (3e-3 + 1e-5 * T / 2))
    phases = c.microbatch_phases(LayerStrategy(tp=2), T, sq, embed=True)
    assert float(phases.fwd) == pytest.approx(4 * tp2.fwd + (1e-3 + 1e-5 * T) + (3e-3 + 1e-5 * T))


def test_measured_overlap_sets_how_much_communication_hides():
    hw = hardware_from_profile(parse_cluster("2xA100-80GB"), hardware_profile(overlap={"hidden_fraction": 0.25}))
    assert hw.overlap == 0.25
    assert float(hw.exposed(1.0, 4.0)) == pytest.approx(0.75)
    assert float(hw.exposed(1.0, 0.5)) == pytest.approx(1.0 - 0.25 * 0.5)
    # ZeRO-3's per-layer gathers: only a quarter of what overlaps the layer's forward is saved; the copy
    # of the gathered weights into the parameters (read and written, at the measured bandwidth) never is
    c = cost_model_from_profiles(TINY, hardware=hardware_profile(overlap={"hidden_fraction": 0.25}),
                                 model=model_profile(), world=2)
    s = LayerStrategy(dp=2, zero=3)
    lc = c.layer(s, Work(tokens=1024.0, sq_tokens=1024.0**2))
    weights = TINY.layer_params * 4  # fp32
    ag = c.hw.collective_time("all_gather", weights, GroupShape(2, 2))
    assert lc.comm_fwd == pytest.approx(ag - 0.25 * min(ag, lc.fwd) + 2 * weights / 8e9)
    assert c.exposed_sync(1.0, 4.0, layers=4) == pytest.approx(1.0 - 0.25 * 1.0)


def test_overlap_outside_zero_one_is_rejected(tmp_path):
    d = hardware_profile(overlap={"hidden_fraction": 1.7}).to_dict()
    with pytest.raises(ProfileError, match="hidden_fraction"):
        load_profile(_write(tmp_path, d), "hardware")


@pytest.mark.parametrize("sample", [[4096, "fast"], [-1, 1e-4], [4096, float("nan")]])
def test_collective_samples_that_are_not_numbers_are_rejected(tmp_path, sample):
    """The cost model prices collectives by these samples: a corrupt one is a one-line profile error."""
    d = _knee_profile().to_dict()
    d["collectives"][0]["samples_bytes_s"][2] = sample
    named = r"collectives\[0\]\.samples_bytes_s(\[2\]\[1\] is NaN, not| (bytes|seconds) must be) a finite"
    with pytest.raises(ProfileError, match=named):
        load_profile(_write(tmp_path, d), "hardware")


def test_parallel_layouts_cover_every_split_that_divides_the_world():
    from flexmesh.profile.model import parallel_layouts

    assert parallel_layouts(TINY, 2, 8) == [(1, "ulysses", 2), (1, "ring", 2), (2, "none", 1)]
    four = parallel_layouts(TINY, 4, 8)
    assert (4, "none", 1) in four and (2, "ring", 2) in four and (1, "ulysses", 4) in four
    assert all(tp * cp in (2, 4) for tp, _, cp in four) and len(four) == len(set(four)) == 8
    assert parallel_layouts(TINY, 1, 8) == []


def test_a_local_cluster_is_priced_by_this_machines_saved_profiles(tmp_path, monkeypatch):
    from flexmesh.profile.use import cost_model_for, cost_model_from_profiles, local_profile

    monkeypatch.setenv("FLEXMESH_CACHE", str(tmp_path))
    with pytest.raises(ProfileError, match="run `flexmesh profile hardware"):
        cost_model_for(TINY, "2xlocal")
    hw, mp = hardware_profile(), model_profile()
    local_profile("hardware").parent.mkdir(parents=True)
    hw.save(local_profile("hardware"))
    alone = cost_model_for(TINY, "4xlocal")  # the hardware profile only: no profile of this model saved
    assert alone.cluster.label == "4xlocal" and alone.cluster.world_size == 4
    mp.save(local_profile("model", TINY, "fp32"))
    both = cost_model_for(TINY, "LOCAL")  # as many devices as were profiled
    assert both.cluster.label == "2xlocal"
    want = cost_model_from_profiles(TINY, hardware=hw, model=mp, world=2)
    from flexmesh.layout.strategy import LayerStrategy

    price = [c.microbatch_time(LayerStrategy(), 1024, 1024**2) for c in (both, want, alone)]
    assert price[0] == price[1] != price[2]  # the same as naming both profiles; the model profile counts
