"""Request traces: the shipped traces' facts, the readers' one-line refusals (file, row, field), synthetic
arrivals, rate scaling, windows, lengths scaled to a context, and Mooncake's prefix reuse."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from flexmesh.data.prefix_reuse import block_reuse, lru_hit_rates
from flexmesh.data.requests import (
    MOONCAKE_BLOCK_TOKENS,
    Request,
    Workload,
    arrival_gaps,
    at_rate,
    constant_lengths,
    load_trace,
    read_plain,
    scale_to_context,
    window,
    with_arrivals,
)
from flexmesh.errors import DataError


def test_shipped_traces_hold_what_their_readme_says():
    conv, code, moon = load_trace("azure-conv"), load_trace("azure-code"), load_trace("mooncake")
    assert (len(conv), len(code), len(moon)) == (19366, 8819, 12031)
    assert np.mean([r.prompt_tokens for r in conv.requests]) == pytest.approx(1155, abs=1)
    assert np.mean([r.output_tokens for r in conv.requests]) == pytest.approx(211, abs=1)
    assert np.mean([r.prompt_tokens for r in moon.requests]) == pytest.approx(12035, abs=1)
    assert np.median([r.prompt_tokens for r in moon.requests]) == pytest.approx(6909, abs=2)
    assert moon.block_tokens == MOONCAKE_BLOCK_TOKENS and conv.block_tokens == 0
    # one hour, in arrival order, starting at 0
    for w in (conv, code, moon):
        times = [r.arrival_s for r in w.requests]
        assert times[0] == 0.0 and times == sorted(times) and 3000 < w.duration_s < 3700
    # every Mooncake prompt has one id per 512-token block
    assert all(len(r.prefix_blocks) == -(-r.prompt_tokens // 512) for r in moon.requests)


def test_mooncake_block_reuse_with_an_unbounded_cache_is_0366_and_bounded_caches_give_a_rising_curve():
    reqs = load_trace("mooncake").requests
    assert round(block_reuse(reqs), 3) == 0.366
    caps = [1_000, 8_000, 32_000, 128_000, 10**7]
    curve = lru_hit_rates(reqs, caps)
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))
    assert curve[0] < 0.1 and curve[-1] == pytest.approx(block_reuse(reqs))


def test_reuse_counts_only_the_leading_run_of_cached_blocks():
    reqs = [Request(0, 0.0, 30, 1, (1, 2, 3)), Request(1, 1.0, 30, 1, (1, 9, 3)), Request(2, 2.0, 30, 1, (1, 9, 3))]
    # request 1: block 1 hit, 9 misses, so 3 is recomputed; request 2: all three hit
    assert block_reuse(reqs) == pytest.approx(4 / 9)
    assert lru_hit_rates(reqs, [1])[0] == pytest.approx(0.0)  # one block cached: each request evicts the last's
    with pytest.raises(DataError, match="no prefix block ids"):
        block_reuse(load_trace("azure-code").requests)


def _write(tmp_path, name, text):
    p = tmp_path / name
    if name.endswith(".gz"):
        p.write_bytes(gzip.compress(text.encode()))
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize("name,text,where", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3\n2023-11-16 18:15:47,x,3\n",
     "a.csv row 3: field 'ContextTokens' is 'x'"),
    ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,12\n", "a.csv row 1: the header lacks GeneratedTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", "a.csv row 2: field 'TIMESTAMP'"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,0,3\n",
     "a.csv row 2: field 'ContextTokens' is 0, outside 1"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
     '{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}\n',
     "m.jsonl row 2: field 'hash_ids' has 3 ids for 600 prompt tokens"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 600, "hash_ids": [1]}\n', "m.jsonl row 1: field 'output_length' is "
     "missing"),
    ("m.jsonl", '{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": []}\n',
     "m.jsonl row 1: field 'timestamp'"),
    ("m.jsonl", "5\n", "m.jsonl row 1: a number, not a JSON object"),
    ("s.json", "[1, 2]\n", "s.json conversation 0: holds no 'conversations' list"),
    ("s.json", '[{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}]',
     "s.json conversation 0: a turn is an object with its text in 'value'"),
    ("p.csv", "arrival_s,prompt_tokens,output_tokens\n0.5,10,2.5\n", "p.csv row 2: field 'output_tokens'"),
    ("p.csv", "arrival_s,prompt_tokens,output_tokens\n0.5,10\n", "p.csv row 2: has 2 fields"),
    ("p.jsonl", '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2, "id": 4}\n'
     '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2, "id": 4}\n', "p.jsonl row 2: field 'id' 4 is given "
     "twice"),
    ("p.jsonl", '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2, "branches": 2, "needed": 3}\n',
     "p.jsonl row 1: field 'needed' is 3, more than its 2 branches"),
    ("p.jsonl.gz", '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2, "prefix_blocks": [4, 5]}\n',
     "requests carry prefix_blocks but no block size"),
    ("t.txt", "1 2 3\n", "a trace is a .csv or .jsonl file"),
])
def test_bad_traces_are_refused_in_one_line_naming_file_row_and_field(tmp_path, name, text, where):
    p = _write(tmp_path, name, text)
    with pytest.raises(DataError) as e:
        load_trace(str(p))
    message = str(e.value)
    assert where in message and "\n" not in message


def test_columns_beside_a_request_are_left_out_and_named(tmp_path):
    p = _write(tmp_path, "p.csv", "arrival_s,prompt_tokens,output_tokens,ttft_ms,e2e_ms\n0.5,10,2,3.1,9\n1,4,4,2,7\n")
    w = load_trace(str(p))
    assert [(r.prompt_tokens, r.output_tokens) for r in w.requests] == [(10, 2), (4, 4)]
    assert w.notes == ("p.csv: columns left out: ttft_ms, e2e_ms (a request has id, arrival_s, prompt_tokens, "
                       "output_tokens, prefix_blocks, tier, branches, needed, branch_tokens)",)
    assert load_trace(str(_write(tmp_path, "q.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n"))).notes == ()


def test_sharegpt_is_sampled_as_vllms_benchmark_samples_it(tmp_path):
    def conv(*turns: str) -> dict:
        return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in zip(("human", "gpt") * 4, turns)]}

    convs = [conv("a" * 400, "b" * 800),  # 100 and 200 tokens: kept
             conv("a" * 400),  # one turn: left out
             conv("a" * 400, "b" * 8),  # a 2-token answer: left out
             conv("a" * 4400, "b" * 40),  # a 1,100-token prompt: left out
             conv("a" * 4000, "b" * 4400),  # 1,000 + 1,100 tokens: left out
             conv("a" * 16, "b" * 16, "c" * 4000)]  # the third turn is no part of it: kept, 4 and 4
    w = load_trace(str(_write(tmp_path, "sg.json", json.dumps(convs))))
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_s) for r in w.requests] == [(100, 200, 0.0), (4, 4, 0.0)]
    assert not w.timed and "2 of 6 conversations kept" in w.notes[0] and "no arrival times" in w.notes[0]


def test_readers_of_each_format(tmp_path):
    azure = _write(tmp_path, "a.csv.gz", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.5000000,10,2\n"
                                          "2023-11-17 00:00:01.2500000,20,4\n")
    w = load_trace(str(azure))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in w.requests] == [(0.0, 10, 2), (1.75, 20, 4)]
    moon = _write(tmp_path, "m.jsonl", json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 5,
                                                   "hash_ids": [7, 8]}) + "\n")
    r = load_trace(str(moon)).requests[0]
    assert (r.arrival_s, r.prefix_blocks, load_trace(str(moon)).block_tokens) == (1.5, (7, 8), 512)
    plain = _write(tmp_path, "p.csv", "id,arrival_s,prompt_tokens,output_tokens,prefix_blocks,tier\n"
                                      "9,2.0,30,3,4 5,1\n3,1.0,10,1,,\n")
    w = read_plain(plain, block_tokens=16)
    assert [(r.id, r.prefix_blocks, r.tier) for r in w.requests] == [(3, (), 0), (9, (4, 5), 1)]
    assert w.block_tokens == 16


def test_synthetic_arrivals_rate_scaling_windows_and_context():
    gaps = arrival_gaps(200_000, 8.0, seed=3)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.01)
    bursty = arrival_gaps(200_000, 8.0, seed=3, burstiness=0.25)
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.02)
    assert bursty.std() / bursty.mean() == pytest.approx(2, rel=0.02)  # cv = 1 / sqrt(shape)
    base = load_trace("azure-code")
    s1, s2 = with_arrivals(base, 3.0, seed=5, n=1000), with_arrivals(base, 3.0, seed=5, n=1000)
    assert s1 == s2 and [r.id for r in s1.requests] == list(range(1000))  # exact: the same seed draws the same arrivals
    assert [r.prompt_tokens for r in s1.requests] == [r.prompt_tokens for r in base.requests[:1000]]
    fast = at_rate(base, 2 * base.rate)
    assert fast.rate == pytest.approx(2 * base.rate)
    assert [r.prompt_tokens for r in fast.requests] == [r.prompt_tokens for r in base.requests]
    w = window(base, 100.0, 200.0, first=50)
    assert len(w) == 50 and w.requests[0].arrival_s >= 0 and max(r.arrival_s for r in w.requests) < 100
    with pytest.raises(DataError, match="no request"):
        window(base, 1e6, 2e6)
    with pytest.raises(DataError, match="no duration"):
        at_rate(constant_lengths(10, 2, n=3), 1.0)
    fit = scale_to_context(load_trace("mooncake"), 8192)
    assert fit.max_total_tokens <= 8192 and fit.block_tokens < 512
    assert scale_to_context(base, 10**6) is base


def test_a_workload_is_immutable_and_ordered():
    w = Workload((Request(0, 0.0, 1, 1),), "x")
    with pytest.raises(AttributeError):
        w.name = "y"  # type: ignore[misc]
    assert w.rate == 0.0 and w.duration_s == 0.0
