"""Sliding windows in the spec (HF configs, round trip) and the cost model's windowed statistic."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cost import CostModel, Work
from flexmesh.cost.training.work import attention_sq
from flexmesh.errors import SpecError
from flexmesh.layout import LayerStrategy as S
from flexmesh.spec import MODEL_PRESETS, from_hf_config, parse_cluster
from flexmesh.spec.model import ModelSpec


# ---- the statistic by brute force ------------------------------------------------------------------
def brute_sq(start: int, end: int, window: int | None) -> int:
    """2 x (query-key pairs) - queries, pairs counted one by one (query i sees keys i - w < j <= i)."""
    pairs = sum(1 for i in range(start, end) for j in range(i + 1) if window is None or i - j < window)
    return 2 * pairs - (end - start)


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 8, 13])
def test_attention_sq_equals_brute_force_pair_count(window):
    for end in range(0, 16):
        for start in range(0, end + 1):
            assert attention_sq(start, end, (window,)) == brute_sq(start, end, window), (start, end)


def test_attention_sq_vectorised_splits_over_pieces_and_averages_layers():
    ends = np.arange(0, 40, dtype=float)
    got = attention_sq(0.0, ends, (6,))
    assert got.tolist() == [brute_sq(0, int(e), 6) for e in ends]
    # pieces of a sequence add up to the whole sequence (the scheduler prices pieces)
    assert attention_sq(0, 11, (4,)) + attention_sq(11, 30, (4,)) == attention_sq(0, 30, (4,))
    mixed = attention_sq(0, 30, (4, None, None, 4))
    assert mixed == pytest.approx((brute_sq(0, 30, 4) + brute_sq(0, 30, None)) / 2)


def test_no_window_is_bit_identical_to_squared_lengths():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 200_000, size=500).astype(float)
    # exact: the same numpy expression on the same array
    assert Work.from_lengths(lens).sq_tokens == float((lens * lens).sum())
    # exact: the same numpy expression on the same array
    assert Work.from_lengths(lens, (None, None)).sq_tokens == float((lens * lens).sum())
    assert Work.uniform(2.5, 4096).sq_tokens == 2.5 * float(4096) ** 2
    assert attention_sq(3.0, 17.0) == 17.0 ** 2 - 3.0 ** 2


def test_windowed_work_costs_less_attention_only_beyond_the_window():
    spec = MODEL_PRESETS["llama2-7b"]
    slid = replace(spec, sliding_window=4096)
    cluster = parse_cluster("8xA100-80GB")
    plain, windowed = CostModel(spec, cluster), CostModel(slid, cluster)
    s = S(tp=2)
    assert windowed.layer_work(s, 4, 4096) == plain.layer_work(s, 4, 4096)  # no document outruns the window
    long_plain, long_win = plain.layer_work(s, 4, 32768), windowed.layer_work(s, 4, 32768)
    assert long_win.tokens == long_plain.tokens
    assert long_win.sq_tokens == 4 * brute_sq_closed(32768, 4096)
    assert windowed.layer(s, long_win).fwd < plain.layer(s, long_plain).fwd
    # the scheduler's and simulator's entry point: per-sequence statistics under the model's windows
    assert windowed.attention_sq(0.0, 32768.0) == brute_sq_closed(32768, 4096)
    assert plain.attention_sq(0.0, 32768.0) == 32768.0 ** 2


def brute_sq_closed(n: int, w: int) -> float:
    """Pairs of a windowed causal sequence in closed form: w(w+1)/2 for the first w queries, w after."""
    pairs = w * (w + 1) // 2 + (n - w) * w
    return float(2 * pairs - n)


def test_scheduler_context_prices_windowed_sequences():
    from flexmesh.schedule.context import ScheduleContext

    cluster = parse_cluster("8xA100-80GB")
    spec = MODEL_PRESETS["llama2-7b"]
    ctx = ScheduleContext(CostModel(spec, cluster), S(), num_ranks=8)
    wctx = ScheduleContext(CostModel(replace(spec, sliding_window=1024), cluster), S(), num_ranks=8)
    t_short = ctx.seq_time(1, [512.0, 1024.0])
    # exact: a window longer than the sequences: the same operations
    assert np.array_equal(wctx.seq_time(1, [512.0, 1024.0]), t_short)
    assert wctx.seq_time(1, [16384.0])[0] < ctx.seq_time(1, [16384.0])[0]


# ---- the spec ----------------------------------------------------------------------------------------
def test_window_fields_validate_and_round_trip():
    m = ModelSpec("m", 3, 64, 4, 4, 128, 100, sliding_window=8, window_layers=(False, True, True))
    assert m.attention_windows == (None, 8, 8)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["window_layers"] == [False, True, True]
    assert ModelSpec.from_dict(d) == m
    plain = ModelSpec("m", 3, 64, 4, 4, 128, 100)
    assert "sliding_window" not in plain.to_dict()  # old dicts, and the profile hashes over them, unchanged
    assert ModelSpec.from_dict(plain.to_dict()) == plain
    assert plain.attention_windows == (None, None, None)
    with pytest.raises(SpecError, match="sliding_window"):
        ModelSpec("m", 3, 64, 4, 4, 128, 100, sliding_window=0)
    with pytest.raises(SpecError, match="window_layers"):
        ModelSpec("m", 3, 64, 4, 4, 128, 100, sliding_window=4, window_layers=(True,))


def _cfg(tmp_path, **kw):
    cfg = {"model_type": "mistral", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "hidden_act": "silu"}
    cfg.update(kw)
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return from_hf_config(tmp_path)


def test_hf_mistral_window(tmp_path):
    assert _cfg(tmp_path, sliding_window=4096).attention_windows == (4096,) * 4
    assert _cfg(tmp_path, sliding_window=None).sliding_window is None
    m = _cfg(tmp_path)
    assert m.sliding_window is None and m.window_layers is None
    # Llama has no sliding window in transformers, whatever the file says
    assert _cfg(tmp_path, model_type="llama", sliding_window=16).sliding_window is None


def test_hf_qwen2_window(tmp_path):
    q = {"model_type": "qwen2", "sliding_window": 32}
    assert _cfg(tmp_path, **q).sliding_window is None  # use_sliding_window defaults to false
    assert _cfg(tmp_path, **q, use_sliding_window=False, max_window_layers=0).sliding_window is None
    # transformers' Qwen2Config: layers i >= max_window_layers slide
    assert _cfg(tmp_path, **q, use_sliding_window=True, max_window_layers=2).attention_windows == (None, None, 32, 32)
    assert _cfg(tmp_path, **q, use_sliding_window=True, max_window_layers=0).window_layers is None
    assert _cfg(tmp_path, **q, use_sliding_window=True, max_window_layers=28).sliding_window is None
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert _cfg(tmp_path, **q, use_sliding_window=True, layer_types=types).attention_windows == (None, 32, None, 32)


def test_hf_window_convention_matches_transformers_configs():
    """Which layers slide: what transformers' Qwen2 attention layers say for the same config."""
    transformers = pytest.importorskip("transformers")
    from flexmesh.spec.hf import hf_sliding_window

    base = dict(num_hidden_layers=5, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=50)
    for kw in (dict(use_sliding_window=True, sliding_window=8, max_window_layers=3),
               dict(use_sliding_window=False, sliding_window=8, max_window_layers=1),
               dict(use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"])):
        cfg = transformers.Qwen2Config(**base, **kw)
        want = tuple(cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types)
        window, layers = hf_sliding_window({**base, **kw}, "qwen2")
        got = tuple(None if window is None or (layers is not None and not layers[i]) else window
                    for i in range(5))
        assert got == want, kw


def test_ring_exposes_fewer_hops_with_a_window():
    cluster = parse_cluster("2x8xA100-80GB")
    spec = MODEL_PRESETS["llama2-7b"]
    plain, windowed = CostModel(spec, cluster), CostModel(replace(spec, sliding_window=512), cluster)
    s = S(cp=8, cp_kind="ring")
    assert plain.ring_hops(8, 1024.0) is None
    tokens, sq = np.array([8192.0]), np.array([8192.0 ** 2])
    # the same work, fewer hops to hide: less exposed communication
    assert windowed.microbatch_phases(s, tokens, sq).comm_fwd < plain.microbatch_phases(s, tokens, sq).comm_fwd
